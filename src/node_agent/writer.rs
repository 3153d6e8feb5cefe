//! The one task that writes to the control-plane socket. Everything the agent sends (frames of
//! every assignment, heartbeats, resent dones, pings) goes through its bounded channel, so
//! frames of one sender stay in order and a slow server pushes back on the senders.

use futures::SinkExt;
use futures::stream::SplitSink;
use switchyard_actors::protocol::NodeFrame;
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};

use super::transport::Ws;

/// Frames waiting for the writer; enough for a burst of chunks from a full batch.
pub(crate) const OUTGOING_CAPACITY: usize = 1024;

/// What the writer is asked to put on the socket.
#[derive(Debug)]
pub(crate) enum Outgoing {
    /// A protocol frame, as one JSON text message.
    Frame(NodeFrame),
    /// A WebSocket ping: the server's automatic pong proves the connection is alive.
    Ping,
    /// Send a close frame and stop.
    Close,
}

/// Writes until asked to close, every sender is gone, or the socket fails; then sends a close
/// frame (best effort). Writes are batched: the socket is flushed when the channel is empty.
pub(crate) async fn write_loop(
    mut sink: SplitSink<Ws, Message>,
    mut rx: mpsc::Receiver<Outgoing>,
) -> Result<(), WsError> {
    while let Some(out) = rx.recv().await {
        let msg = match out {
            Outgoing::Frame(frame) => match serde_json::to_string(&frame) {
                Ok(text) => Message::text(text),
                Err(e) => {
                    tracing::error!(error = %e, "frame not serialisable; dropped");
                    continue;
                }
            },
            Outgoing::Ping => Message::Ping(Default::default()),
            Outgoing::Close => break,
        };
        sink.feed(msg).await?;
        if rx.is_empty() {
            sink.flush().await?;
        }
    }
    sink.flush().await?;
    // The server may already be gone; a failed close changes nothing.
    let _ = sink.send(Message::Close(None)).await;
    let _ = sink.close().await;
    Ok(())
}
