//! Hearing one pub/sub channel for as long as the listener wants it. A subscription ends
//! when the coordinator's pub/sub connection drops — Redis restarted, a failover, a network
//! blip — and nothing published meanwhile comes back; a listener that stopped there would
//! leave its channel unheard for good (a node's socket deaf to every other replica's
//! commands after Redis came back empty). So the subscription is taken again, with backoff,
//! until the listener is gone.

use std::sync::Arc;
use std::time::Duration;

use crate::ports::{CoordError, Coordinator};
use crate::tasks::TaskGuard;

/// The first pause before subscribing again; it doubles up to [`MAX_PAUSE`] while the
/// coordinator stays away, and starts over after a subscription succeeds.
const FIRST_PAUSE: Duration = Duration::from_millis(100);
/// The longest pause between two attempts.
const MAX_PAUSE: Duration = Duration::from_secs(5);

/// Subscribes to `channel` now (an error if the coordinator cannot be reached: the caller
/// decides whether to start without it), then hands every message to `heard` from a task of
/// its own, subscribing again whenever the subscription ends, until `heard` returns false
/// (whoever it feeds is gone). `task` names the task in `switchyard_tasks_alive`.
pub async fn listen<F>(
    coordinator: Arc<dyn Coordinator>,
    channel: String,
    task: &'static str,
    mut heard: F,
) -> Result<tokio::task::JoinHandle<()>, CoordError>
where
    F: FnMut(Vec<u8>) -> bool + Send + 'static,
{
    let mut rx = coordinator.subscribe(&channel).await?;
    Ok(tokio::spawn(async move {
        let _guard = TaskGuard::new(task);
        loop {
            while let Some(payload) = rx.recv().await {
                if !heard(payload) {
                    return;
                }
            }
            tracing::warn!(channel, "lost a pub/sub channel; subscribing again");
            let mut pause = FIRST_PAUSE;
            rx = loop {
                tokio::time::sleep(pause).await;
                match coordinator.subscribe(&channel).await {
                    Ok(rx) => break rx,
                    Err(e) => {
                        tracing::warn!(channel, error = %e, "cannot subscribe to a pub/sub channel; retrying");
                        pause = (pause * 2).min(MAX_PAUSE);
                    }
                }
            };
        }
    }))
}

#[cfg(test)]
mod tests {
    #![expect(clippy::unwrap_used)]

    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::listen;
    use crate::ports::Coordinator;
    use crate::ports::memory::MapCoordinator;

    #[tokio::test(start_paused = true)]
    async fn hears_again_after_the_subscription_ends_and_stops_when_told() {
        let coordinator = Arc::new(MapCoordinator::with_pubsub());
        let heard = Arc::new(AtomicUsize::new(0));
        let count = heard.clone();
        let task = listen(
            coordinator.clone(),
            "ch".into(),
            "test_listener",
            move |p| {
                count.fetch_add(1, Ordering::SeqCst);
                p != b"stop"
            },
        )
        .await
        .unwrap();
        coordinator.publish("ch", b"a".to_vec()).await.unwrap();
        tokio::task::yield_now().await;
        assert_eq!(heard.load(Ordering::SeqCst), 1);
        // The connection drops: every subscription ends, and what is published meanwhile
        // reaches nobody.
        coordinator.drop_subscriptions();
        assert_eq!(
            coordinator.publish("ch", b"lost".to_vec()).await.unwrap(),
            0
        );
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        assert_eq!(coordinator.publish("ch", b"b".to_vec()).await.unwrap(), 1);
        tokio::task::yield_now().await;
        assert_eq!(heard.load(Ordering::SeqCst), 2);
        coordinator.publish("ch", b"stop".to_vec()).await.unwrap();
        task.await.unwrap();
        assert_eq!(coordinator.publish("ch", b"c".to_vec()).await.unwrap(), 0);
    }
}
