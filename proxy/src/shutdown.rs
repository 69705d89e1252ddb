//! A cloneable shutdown trigger shared by the listeners, the probes and the
//! embedding program (signal handler, test, demo).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

/// Triggering it stops accepting, lets in-flight requests drain up to
/// `timeouts.shutdown_drain`, then stops the sidecar.
#[derive(Debug, Clone, Default)]
pub struct Shutdown {
    token: CancellationToken,
    /// Set before the token is cancelled: the check a waiter makes on every
    /// wake-up, one atomic load where the token's takes two locks.
    fired: Arc<AtomicBool>,
}

impl Shutdown {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn trigger(&self) {
        self.fired.store(true, Ordering::Release);
        self.token.cancel();
    }

    pub fn is_triggered(&self) -> bool {
        self.fired.load(Ordering::Acquire)
    }

    /// Resolves once triggered. Cheap to poll again and again: a connection
    /// selects on it beside the connection itself, so it is polled on every
    /// wake-up of the connection's task, that is several times per request.
    pub fn triggered(&self) -> Triggered<'_> {
        Triggered {
            fired: &self.fired,
            wait: self.token.cancelled(),
            registered: None,
        }
    }
}

pin_project_lite::pin_project! {
    /// [`Shutdown::triggered`]'s future. Registered with the token once per
    /// task waker; a later poll with the same waker only loads the flag, since
    /// `trigger` sets the flag before it wakes that waker. Not boxed: loops
    /// make one per message they select on.
    pub struct Triggered<'a> {
        fired: &'a AtomicBool,
        #[pin]
        wait: WaitForCancellationFuture<'a>,
        // The waker the token will wake, once registered.
        registered: Option<Waker>,
    }
}

impl Future for Triggered<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.project();
        if this.fired.load(Ordering::Acquire) {
            return Poll::Ready(());
        }
        if this
            .registered
            .as_ref()
            .is_some_and(|w| w.will_wake(cx.waker()))
        {
            return Poll::Pending;
        }
        match this.wait.poll(cx) {
            Poll::Ready(()) => Poll::Ready(()),
            Poll::Pending => {
                *this.registered = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn a_waiter_polled_many_times_still_wakes_on_trigger() {
        let s = Shutdown::new();
        let waiter = {
            let s = s.clone();
            tokio::spawn(async move {
                let mut t = std::pin::pin!(s.triggered());
                // Polled repeatedly with the same waker, as a select! loop does.
                for _ in 0..3 {
                    assert!(futures_poll_once(t.as_mut()).await.is_pending());
                }
                t.await;
                s.is_triggered()
            })
        };
        tokio::task::yield_now().await;
        s.trigger();
        assert!(waiter.await.unwrap());
    }

    #[tokio::test]
    async fn an_already_triggered_shutdown_resolves_at_once() {
        let s = Shutdown::new();
        s.trigger();
        s.triggered().await;
        assert!(s.is_triggered());
    }

    /// Polls `f` once, returning what the poll returned.
    async fn futures_poll_once<F: Future + Unpin>(mut f: F) -> Poll<F::Output> {
        std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut f).poll(cx))).await
    }
}
