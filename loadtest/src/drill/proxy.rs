//! A TCP proxy a drill can cut: while cut it closes every connection through it and refuses
//! new ones, as a dead link or a firewall change would; restored, it forwards again.

use std::time::Duration;

use anyhow::Context;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// See the module documentation.
#[derive(Debug)]
pub struct CutProxy {
    /// The port it listens on (127.0.0.1).
    pub port: u16,
    cut: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl CutProxy {
    /// Forwards 127.0.0.1:`port` (a free one) to `target` (`host:port`).
    pub async fn start(target: String) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the proxy")?;
        let port = listener.local_addr()?.port();
        let (cut, watching) = watch::channel(false);
        let task = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                if *watching.borrow() {
                    continue;
                }
                let (target, mut watching) = (target.clone(), watching.clone());
                tokio::spawn(async move {
                    let Ok(Ok(mut outbound)) =
                        tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(&target))
                            .await
                    else {
                        return;
                    };
                    let mut inbound = inbound;
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = watching.wait_for(|cut| *cut) => {}
                    }
                });
            }
        });
        Ok(Self { port, cut, task })
    }

    /// Closes every connection and refuses new ones until [`Self::restore`].
    pub fn cut(&self) {
        self.cut.send_replace(true);
    }

    /// Forwards again.
    pub fn restore(&self) {
        self.cut.send_replace(false);
    }
}

impl Drop for CutProxy {
    fn drop(&mut self) {
        self.cut.send_replace(true);
        self.task.abort();
    }
}
