//! Assembly of one server replica: storage and coordination, the actors (the supervision
//! tree: a queue per model, node actors, generations), the HTTP routes, and a graceful stop. `serve`, `demo` and the
//! integration tests all start a replica through [`Server::start`].

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use switchyard_actors::budget::{BudgetConfig, TeamBudgets};
use switchyard_actors::cluster::NodeView;
use switchyard_actors::generation::{Generations, Launcher};
use switchyard_actors::model_queue::ModelQueueHandle;
use switchyard_actors::node::NodeTrust;
use switchyard_actors::ports::{Clock, Coordinator, SystemClock};
use switchyard_actors::replica::{ReplicaActors, ReplicaArgs};
use switchyard_actors::supervision::Supervision;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::admission::Admission;
use crate::auth::Authenticator;
use crate::config::Config;
use crate::quota::Limits;
use crate::store::Store;
use crate::tokens::PromptCounter;

/// Registration limiter: a GCRA bucket shared by every node connection of this replica.
pub type RegistrationLimiter = governor::DefaultDirectRateLimiter;

/// Everything the HTTP handlers share.
#[derive(Debug)]
pub struct AppState {
    /// The validated configuration.
    pub config: Config,
    /// This replica's id.
    pub replica_id: String,
    /// Ledger and configuration storage.
    pub store: Arc<dyn Store>,
    /// Cluster coordination.
    pub coordinator: Arc<dyn Coordinator>,
    /// The actors' supervision tree (starts node actors; reports a subsystem given up on).
    pub supervision: Supervision,
    /// Starts generations: the one path from a request's admission job to a running
    /// generation (its `generations` is the tree's handle, valid across restarts).
    pub launcher: Launcher,
    /// The ledger every generation reserves through: each team's reservations
    /// group-committed by its budget actor, everything else straight to the store.
    pub budgets: Arc<TeamBudgets>,
    /// The queue of every model, by resolved name (the tree's handles, valid across restarts).
    pub queues: BTreeMap<String, ModelQueueHandle>,
    /// This replica's node actors: the connections it holds and the proxies of the nodes
    /// other replicas hold (see [`switchyard_actors::cluster::NodeView`]).
    pub view: Arc<NodeView>,
    /// API-key verification.
    pub auth: Authenticator,
    /// Admits requests (limits, lifecycle, measuring, reservation) before they run.
    pub admission: Admission,
    /// Registrations per second.
    pub registrations: RegistrationLimiter,
    /// Renders `/metrics`.
    pub metrics: PrometheusHandle,
    /// Time.
    pub clock: Arc<dyn Clock>,
    /// Cancelled when the replica stops accepting work.
    pub shutdown: CancellationToken,
}

/// Failures while starting a replica.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// An actor could not be spawned.
    #[error("starting actors: {0}")]
    Actors(String),
    /// Binding or serving failed.
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    /// A model's tokenizer could not be loaded.
    #[error("{0}")]
    Tokenizer(#[from] crate::tokens::TokenizerError),
    /// The listener's certificate or key could not be loaded, or the JWKS client built.
    #[error("tls: {0}")]
    Tls(#[from] crate::tls::TlsError),
}

/// The process-wide Prometheus recorder (one per process, however many replicas a test runs).
fn metrics_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            // Histograms with buckets (Prometheus `histogram`, not summaries), so latency SLOs
            // can be aggregated across replicas.
            let seconds = [
                0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0,
            ];
            let rates = [1.0, 5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 75.0, 100.0, 200.0];
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &seconds)
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Suffix("_per_second".into()), &rates)
                });
            let builder = match builder {
                Ok(b) => b,
                Err(e) => {
                    tracing::warn!(error = %e, "histogram buckets rejected; using summaries");
                    PrometheusBuilder::new()
                }
            };
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            // The console's last hour of the queues is copied from what is recorded here.
            if metrics::set_global_recorder(crate::recent::Tee::new(recorder)).is_err() {
                tracing::warn!("a metrics recorder was already installed");
            }
            handle
        })
        .clone()
}

/// The JWT verifier, when the JWKS URL, audience and issuer are all configured.
fn jwt_verifier(
    config: &Config,
    clock: &Arc<dyn Clock>,
) -> Result<Option<crate::jwt::JwtVerifier>, StartError> {
    let (Some(url), Some(aud), Some(iss)) = (
        config.jwks_url.as_ref(),
        config.jwt_audience.as_ref(),
        config.jwt_issuer.as_ref(),
    ) else {
        return Ok(None);
    };
    let cfg = crate::jwt::JwtConfig::new(url.clone(), aud.clone(), iss.clone());
    Ok(Some(crate::jwt::JwtVerifier::with_clock(
        cfg,
        crate::jwt::http_client()?,
        clock.clone(),
    )))
}

/// Relays cancels published by other replicas to the generations running here. A lost
/// subscription (Redis restarted, the connection dropped) is taken again, with a growing
/// pause up to 5 s, until the replica shuts down.
async fn spawn_cancel_listener(state: &Arc<AppState>) {
    spawn_generation_listener(
        state,
        crate::http::CANCEL_CHANNEL,
        "cancel_listener",
        |generations, id| {
            generations.cancel(id);
        },
    );
}

/// Hears of readers that came back to a generation through another replica
/// (`GET /v1/generations/{id}/events`, a retried Idempotency-Key) and tells the generation,
/// if it runs here, so its cancel grace no longer ends it.
async fn spawn_client_back_listener(state: &Arc<AppState>) {
    spawn_generation_listener(
        state,
        crate::http::CLIENT_BACK_CHANNEL,
        "client_back_listener",
        |generations, id| {
            crate::http::client_back(generations, id);
        },
    );
}

/// Runs `act` on this replica's generations for every id published on `channel`, until
/// the replica shuts down; a lost subscription is renewed with backoff.
fn spawn_generation_listener(
    state: &Arc<AppState>,
    channel: &'static str,
    kind: &'static str,
    act: fn(&Generations, &str),
) {
    let coordinator = state.coordinator.clone();
    let generations = state.launcher.generations.clone();
    let stop = state.shutdown.clone();
    tokio::spawn(async move {
        let _guard = switchyard_actors::tasks::TaskGuard::new(kind);
        let mut pause = Duration::from_millis(100);
        loop {
            match coordinator.subscribe(channel).await {
                Ok(mut cancels) => {
                    pause = Duration::from_millis(100);
                    loop {
                        tokio::select! {
                            () = stop.cancelled() => return,
                            msg = cancels.recv() => match msg {
                                Some(id) => {
                                    if let Ok(id) = String::from_utf8(id) {
                                        act(&generations, &id);
                                    }
                                }
                                None => break,
                            },
                        }
                    }
                    tracing::warn!(
                        channel,
                        "a generation subscription closed; subscribing again"
                    );
                }
                Err(e) => {
                    tracing::warn!(channel, error = %e, "cannot hear other replicas on a generation channel; retrying")
                }
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(pause) => {}
            }
            pause = (pause * 2).min(Duration::from_secs(5));
        }
    });
}

/// A running replica.
#[derive(Debug)]
pub struct Server {
    addr: SocketAddr,
    state: Arc<AppState>,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    /// Starts a replica on `listener` with the given backends.
    pub async fn start(
        config: Config,
        store: Arc<dyn Store>,
        coordinator: Arc<dyn Coordinator>,
        listener: TcpListener,
    ) -> Result<Self, StartError> {
        // First: a bad certificate file must stop the start before anything runs.
        let tls = crate::http::listener::acceptor(&config.listener)?;
        Self::start_with_tls(config, store, coordinator, listener, tls).await
    }

    async fn start_with_tls(
        config: Config,
        store: Arc<dyn Store>,
        coordinator: Arc<dyn Coordinator>,
        listener: TcpListener,
        tls: Option<crate::http::listener::Acceptor>,
    ) -> Result<Self, StartError> {
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let replica_id = config
            .replica_id
            .clone()
            .unwrap_or_else(|| format!("replica-{:08x}", rand::random::<u32>()));
        let prompts = PromptCounter::load(config.models.iter().map(|m| {
            (
                m.name.as_str(),
                m.tokenizer.as_deref(),
                m.chat_template.as_deref(),
            )
        }))?;
        // One owner per model queue and per team budget in the cluster (alone, this replica
        // takes every lease).
        let actors = ReplicaActors::start(ReplicaArgs {
            replica_id: replica_id.clone(),
            ledger: store.clone(),
            lifecycle: Some(store.clone()),
            coordinator: coordinator.clone(),
            clock: clock.clone(),
            models: config
                .models
                .iter()
                .map(|model| (model.name.clone(), config.queue_config(model)))
                .collect(),
            lease_ttl: Duration::from_secs(config.owner_lease_secs),
            budget: BudgetConfig::default(),
            heartbeat_timeout: Duration::from_secs(config.nodes.heartbeat_timeout_secs),
            trust: NodeTrust {
                max_violations: config.trust.max_violations,
                window: Duration::from_secs(config.trust.violation_window_secs),
            },
            timeouts: config.generation_timeouts(),
            bound: config.stream_bound(),
            retention: Duration::from_millis(u64::try_from(config.retention_ms()).unwrap_or(0)),
            accounting: Some(Arc::new(crate::store::accounting::StoreAccounting::spawn(
                store.clone(),
            ))),
        })
        .await
        .map_err(|e| StartError::Actors(e.to_string()))?;
        let queues = actors.supervision.queues.clone();
        let shutdown = CancellationToken::new();
        actors.join(shutdown.clone()).await;
        let ReplicaActors {
            supervision,
            budgets,
            view,
            launcher,
            ..
        } = actors;
        // A stream's place outlives the longest request (plus the wait for its usage report).
        let slot_ttl = Duration::from_secs(
            config.timeouts.total_secs
                + config.timeouts.settle_wait_secs
                + config.timeouts.sweep_grace_secs,
        );
        let per_second =
            NonZeroU32::new(config.nodes.registrations_per_second).unwrap_or(NonZeroU32::MIN);
        let metrics = metrics_handle();
        switchyard_actors::metric_names::zero_known_series(
            config.models.iter().map(|m| m.name.as_str()),
        );
        let state = Arc::new(AppState {
            auth: Authenticator::new(
                store.clone(),
                clock.clone(),
                jwt_verifier(&config, &clock)?,
                crate::auth::Defaults {
                    rpm: config.default_rpm,
                    tokens_per_day: config.default_tokens_per_day,
                    jwt_max_streams: config.jwt_max_streams,
                    key_tiers: config.service_tiers.keys(),
                    jwt_tiers: config.service_tiers.jwt(),
                },
            ),
            admission: Admission::new(
                Arc::new(config.clone()),
                store.clone(),
                queues.clone(),
                Limits::new(coordinator.clone(), clock.clone(), slot_ttl),
                prompts,
                clock.clone(),
            ),
            registrations: governor::RateLimiter::direct(governor::Quota::per_second(per_second)),
            replica_id,
            store,
            coordinator,
            supervision,
            launcher,
            budgets,
            queues,
            view,
            metrics,
            clock,
            shutdown,
            config,
        });
        // Rows still reserved after the longest request plus the wait for its usage report
        // (and a margin) are swept.
        tokio::spawn(crate::sweeper::run(
            state.store.clone(),
            state.coordinator.clone(),
            state.replica_id.clone(),
            state.clock.clone(),
            Duration::from_secs(state.config.timeouts.sweep_interval_secs.max(1)),
            slot_ttl,
            state.config.retention_ms(),
            state.shutdown.clone(),
        ));
        spawn_cancel_listener(&state).await;
        spawn_client_back_listener(&state).await;
        let addr = listener.local_addr()?;
        let app = crate::http::router(state.clone());
        let shutdown = state.shutdown.clone();
        let send_buffer = state.config.generations.socket_send_buffer_bytes;
        let task = tokio::spawn(crate::http::listener::serve(
            listener,
            app,
            state.config.listener.clone(),
            send_buffer,
            tls,
            shutdown,
        ));
        tracing::info!(%addr, replica_id = %state.replica_id, "switchyard listening");
        Ok(Self { addr, state, task })
    }

    /// Binds `addr` and starts.
    pub async fn bind(
        config: Config,
        store: Arc<dyn Store>,
        coordinator: Arc<dyn Coordinator>,
    ) -> Result<Self, StartError> {
        // The certificate is loaded before the port is taken: a bad file leaves it free.
        let tls = crate::http::listener::acceptor(&config.listener)?;
        let listener = TcpListener::bind(config.listen).await?;
        Self::start_with_tls(config, store, coordinator, listener, tls).await
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`, or `https://ADDR` when the listener terminates TLS.
    pub fn base_url(&self) -> String {
        let scheme = match self.state.config.listener.tls_cert {
            Some(_) => "https",
            None => "http",
        };
        format!("{scheme}://{}", self.addr)
    }

    /// Shared state (for tests and the demo).
    pub fn state(&self) -> &Arc<AppState> {
        &self.state
    }

    /// Stops accepting requests, lets in-flight ones finish for up to `grace`, then closes
    /// node connections and stops the actors.
    pub async fn shutdown(self, grace: Duration) {
        self.state.shutdown.cancel();
        let mut task = self.task;
        if tokio::time::timeout(grace, &mut task).await.is_err() {
            task.abort();
        }
        for node in self.state.view.local_nodes() {
            node.stop();
        }
        // Queues first, on purpose: their waiting generations end typed before the tree
        // (and every actor still in it) stops.
        for queue in self.state.queues.values() {
            queue.stop();
        }
        self.state.supervision.stop();
        self.state.budgets.stop();
    }
}
