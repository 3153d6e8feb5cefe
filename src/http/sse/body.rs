//! The body of every SSE response: whatever events are ready when hyper asks for more go out
//! as one chunk, rendered straight into a reused buffer, so a reader that is behind gets many
//! tokens per write instead of one allocation and one write per token. A `: keep-alive`
//! comment follows each [`KEEP_ALIVE`] of silence. The bytes and headers are axum's `Sse`
//! ones with `KeepAlive::text("keep-alive")`, so clients see no difference.

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use bytes::{BufMut, Bytes, BytesMut};
use http_body::Frame;
use tokio::time::{Instant, Sleep};

use super::KEEP_ALIVE;

/// The comment sent after [`KEEP_ALIVE`] of silence (what axum's keep-alive wrote).
pub(crate) const KEEP_ALIVE_COMMENT: &[u8] = b": keep-alive\n\n";
/// A write stops taking events past this many bytes; the rest go in the next one.
const MAX_WRITE: usize = 64 * 1024;
/// Spare capacity the buffer keeps before a write. Once hyper has dropped the previous
/// chunk the buffer takes its allocation back, so a stream reuses one allocation.
const SPARE: usize = 4 * 1024;

/// Where a stream's events come from, rendered.
pub(crate) trait SseEvents: Send + 'static {
    /// Renders what is ready now into `out` (possibly nothing, as for events a resuming
    /// client already has). `Pending` once nothing more is ready (the waker is registered);
    /// [`Step::End`] after the last event.
    fn poll_write(&mut self, cx: &mut Context<'_>, out: &mut SseText) -> Poll<Step>;
}

/// What [`SseEvents::poll_write`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Made progress; more may be ready.
    More,
    /// The stream is over (what was written is its end).
    End,
}

/// SSE text being gathered for one write.
#[derive(Debug, Default)]
pub(crate) struct SseText {
    buf: BytesMut,
}

impl SseText {
    /// A `name: value` line (event names and ids: never newlines).
    pub(crate) fn field(&mut self, name: &str, value: &str) {
        self.buf.put_slice(name.as_bytes());
        self.buf.put_slice(b": ");
        self.buf.put_slice(value.as_bytes());
        self.buf.put_u8(b'\n');
    }

    /// The `id: n` line.
    pub(crate) fn id(&mut self, n: u64) {
        let _ = fmt::Write::write_fmt(&mut self.buf, format_args!("id: {n}\n"));
    }

    /// The `data:` field, its text written by `write`. A line break in it starts a new
    /// `data: ` line, as axum did (JSON from an engine may hold whitespace line breaks).
    pub(crate) fn data(&mut self, write: impl FnOnce(&mut BytesMut)) {
        self.buf.put_slice(b"data: ");
        let start = self.buf.len();
        write(&mut self.buf);
        if self.buf[start..].iter().any(|&b| b == b'\n' || b == b'\r') {
            let text = self.buf.split_off(start);
            for &b in text.iter() {
                self.buf.put_u8(b);
                if b == b'\n' || b == b'\r' {
                    self.buf.put_slice(b"data: ");
                }
            }
        }
        self.buf.put_u8(b'\n');
    }

    /// Ends the event (its blank line).
    pub(crate) fn end(&mut self) {
        self.buf.put_u8(b'\n');
    }

    fn len(&self) -> usize {
        self.buf.len()
    }

    /// What was gathered, leaving the buffer empty with its spare capacity.
    fn take(&mut self) -> Bytes {
        let chunk = self.buf.split().freeze();
        self.buf.reserve(SPARE);
        chunk
    }
}

/// The body: see the module documentation.
pub(crate) struct SseBody<E> {
    events: E,
    text: SseText,
    /// The events are over: the body ends after what is gathered.
    ended: bool,
    /// Fires [`KEEP_ALIVE`] after `last_write` (re-armed lazily, not on every write).
    keep_alive: Pin<Box<Sleep>>,
    /// When the last bytes went out.
    last_write: Instant,
    interval: Duration,
}

impl<E: SseEvents> SseBody<E> {
    pub(crate) fn new(events: E) -> Self {
        Self::with_interval(events, KEEP_ALIVE)
    }

    fn with_interval(events: E, interval: Duration) -> Self {
        let now = Instant::now();
        let mut text = SseText::default();
        text.buf.reserve(SPARE);
        Self {
            events,
            text,
            ended: false,
            keep_alive: Box::pin(tokio::time::sleep_until(now + interval)),
            last_write: now,
            interval,
        }
    }
}

impl<E: SseEvents + Unpin> http_body::Body for SseBody<E> {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        while !this.ended && this.text.len() < MAX_WRITE {
            match this.events.poll_write(cx, &mut this.text) {
                Poll::Ready(Step::More) => {}
                Poll::Ready(Step::End) => this.ended = true,
                Poll::Pending => break,
            }
        }
        if this.text.len() > 0 {
            this.last_write = Instant::now();
            return Poll::Ready(Some(Ok(Frame::data(this.text.take()))));
        }
        if this.ended {
            return Poll::Ready(None);
        }
        loop {
            ready!(this.keep_alive.as_mut().poll(cx));
            let now = Instant::now();
            let due = this.last_write + this.interval;
            if due > now {
                this.keep_alive.as_mut().reset(due);
                continue;
            }
            this.last_write = now;
            this.keep_alive.as_mut().reset(now + this.interval);
            return Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(
                KEEP_ALIVE_COMMENT,
            )))));
        }
    }
}

/// Events rendered before their response starts: until they wrote something or ended.
pub(crate) struct Primed<E> {
    /// The events, to go on with.
    pub(crate) events: E,
    text: SseText,
    ended: bool,
}

impl<E: SseEvents + Unpin> Primed<E> {
    /// Renders `events` until they write something or end, so that a request whose stream
    /// would hold nothing can still be answered with an error status (a resume past the end).
    /// Only for sources that do not wait on a live generation: this waits as long as they do.
    pub(crate) async fn new(mut events: E) -> Self {
        let mut text = SseText::default();
        let mut ended = false;
        while !ended && text.len() == 0 {
            ended = std::future::poll_fn(|cx| events.poll_write(cx, &mut text)).await == Step::End;
        }
        Self {
            events,
            text,
            ended,
        }
    }

    /// The response: what was rendered, then the rest of the events.
    pub(crate) fn response(self) -> Response {
        let mut body = SseBody::new(self.events);
        body.text.buf.put_slice(&self.text.buf);
        body.ended = self.ended;
        with_headers(body)
    }
}

/// A `text/event-stream` response of `events`, with the headers axum's `Sse` sets.
pub(crate) fn response<E: SseEvents + Unpin>(events: E) -> Response {
    with_headers(SseBody::new(events))
}

fn with_headers<E: SseEvents + Unpin>(body: SseBody<E>) -> Response {
    (
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream"),
            ),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
        ],
        Body::new(body),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    #![expect(clippy::unwrap_used, clippy::expect_used)]

    use std::collections::VecDeque;

    use http_body::Body as _;
    use http_body_util::BodyExt;

    use super::*;

    /// Events fed by the test: `Some(text)` is ready now, `None` ends the stream; an empty
    /// queue is pending.
    struct Scripted {
        ready: std::sync::Arc<std::sync::Mutex<VecDeque<Option<&'static str>>>>,
        waker: std::sync::Arc<std::sync::Mutex<Option<std::task::Waker>>>,
    }

    impl SseEvents for Scripted {
        fn poll_write(&mut self, cx: &mut Context<'_>, out: &mut SseText) -> Poll<Step> {
            match self.ready.lock().unwrap().pop_front() {
                Some(Some(text)) => {
                    out.data(|b| b.put_slice(text.as_bytes()));
                    out.end();
                    Poll::Ready(Step::More)
                }
                Some(None) => Poll::Ready(Step::End),
                None => {
                    *self.waker.lock().unwrap() = Some(cx.waker().clone());
                    Poll::Pending
                }
            }
        }
    }

    async fn frame(body: &mut SseBody<Scripted>) -> Option<Bytes> {
        std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx))
            .await
            .map(|f| f.unwrap().into_data().unwrap())
    }

    #[tokio::test]
    async fn every_ready_event_goes_out_in_one_chunk() {
        let ready = std::sync::Arc::new(std::sync::Mutex::new(VecDeque::from([
            Some("a"),
            Some("b\nc"),
            Some("d"),
            None,
        ])));
        let mut body = SseBody::new(Scripted {
            ready,
            waker: Default::default(),
        });
        assert_eq!(
            &frame(&mut body).await.unwrap()[..],
            b"data: a\n\ndata: b\ndata: c\n\ndata: d\n\n"
        );
        assert_eq!(frame(&mut body).await, None);
    }

    #[tokio::test(start_paused = true)]
    async fn silence_brings_a_keep_alive_comment_and_writes_postpone_it() {
        let ready = std::sync::Arc::new(std::sync::Mutex::new(VecDeque::new()));
        let waker: std::sync::Arc<std::sync::Mutex<Option<std::task::Waker>>> = Default::default();
        let mut body = SseBody::with_interval(
            Scripted {
                ready: ready.clone(),
                waker: waker.clone(),
            },
            Duration::from_secs(5),
        );
        let start = Instant::now();
        assert_eq!(&frame(&mut body).await.unwrap()[..], KEEP_ALIVE_COMMENT);
        assert_eq!(start.elapsed(), Duration::from_secs(5));
        // An event 3 s later puts the next comment 5 s after it, not after the first.
        let feed = {
            let (ready, waker) = (ready.clone(), waker.clone());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs(3)).await;
                ready.lock().unwrap().push_back(Some("x"));
                if let Some(w) = waker.lock().unwrap().take() {
                    w.wake();
                }
            })
        };
        assert_eq!(&frame(&mut body).await.unwrap()[..], b"data: x\n\n");
        assert_eq!(start.elapsed(), Duration::from_secs(8));
        feed.await.expect("feeder");
        assert_eq!(&frame(&mut body).await.unwrap()[..], KEEP_ALIVE_COMMENT);
        assert_eq!(start.elapsed(), Duration::from_secs(13));
    }

    #[tokio::test]
    async fn the_response_has_sse_headers() {
        let ready = std::sync::Arc::new(std::sync::Mutex::new(VecDeque::from([
            Some("[DONE]"),
            None,
        ])));
        let response = response(Scripted {
            ready,
            waker: Default::default(),
        });
        assert_eq!(
            response.headers()[header::CONTENT_TYPE],
            "text/event-stream"
        );
        assert_eq!(response.headers()[header::CACHE_CONTROL], "no-cache");
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&bytes[..], b"data: [DONE]\n\n");
    }
}
