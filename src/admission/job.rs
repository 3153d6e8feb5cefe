//! Admission as a job a generation runs as its first step ([`AdmissionJob`]): the request
//! and its id, bound to the replica's [`Admission`], run once.

use async_trait::async_trait;
use switchyard_actors::ports::admission::{AdmissionJob, Admit};

use super::{Admission, AdmissionError, Request};

/// The admission of one request, not yet run.
#[derive(Debug)]
pub struct AdmissionRun {
    /// The replica's admission.
    admission: Admission,
    /// The validated request.
    request: Request,
    /// The id the generation gets unless a readmitted record already has one.
    id: String,
}

impl AdmissionRun {
    pub(super) fn new(admission: Admission, request: Request, id: &str) -> Self {
        Self {
            admission,
            request,
            id: id.to_owned(),
        }
    }
}

#[async_trait]
impl AdmissionJob for AdmissionRun {
    type Error = AdmissionError;

    async fn run(self: Box<Self>) -> Result<Admit, AdmissionError> {
        let Self {
            admission,
            request,
            id,
        } = *self;
        admission.admit(request, &id).await
    }
}
