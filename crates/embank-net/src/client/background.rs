//! A client's background thread (the prober, the shard map's watcher): it sleeps until a
//! time it names or until its owner raises a signal, and ends when stopped (by its owner,
//! or when the owner is dropped) or when its client is dropped or closed. Between rounds
//! it holds the client only weakly.

use std::sync::{Arc, Weak};
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

use super::{Client, Inner};

/// Signals raised since the thread last woke (a bit each, named by the owner) and
/// whether it is to stop.
#[derive(Default)]
struct State {
    stop: bool,
    raised: u32,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    wake: Condvar,
}

/// The owner's side of the thread: raises signals, and stops it (on drop too).
pub(super) struct Background {
    shared: Arc<Shared>,
}

/// The thread's side: sleeps, and takes its client for a round.
pub(super) struct Sleeper {
    shared: Arc<Shared>,
    client: Weak<Inner>,
}

impl Background {
    /// Runs `body` on a thread named `name` for `client`; if the thread cannot start,
    /// logs `unstarted` (what is lost without it).
    pub(super) fn spawn(
        name: &str,
        client: &Client,
        unstarted: &str,
        body: impl FnOnce(Sleeper) + Send + 'static,
    ) -> Background {
        let shared = Arc::new(Shared::default());
        let sleeper = Sleeper { shared: Arc::clone(&shared), client: Arc::downgrade(&client.inner) };
        if let Err(e) = std::thread::Builder::new().name(name.into()).spawn(move || body(sleeper)) {
            tracing::warn!(error = %e, "{unstarted}");
        }
        Background { shared }
    }

    /// Wakes the thread with `signals` (kept until it wakes).
    pub(super) fn raise(&self, signals: u32) {
        let mut st = self.shared.state.lock();
        if st.raised & signals != signals {
            st.raised |= signals;
            self.shared.wake.notify_all();
        }
    }

    /// Stops the thread (it ends at its next wake-up; nothing waits for it).
    pub(super) fn stop(&self) {
        self.shared.state.lock().stop = true;
        self.shared.wake.notify_all();
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Sleeper {
    /// Sleeps until `until` or until a signal is raised: the signals raised meanwhile
    /// (then cleared), or `None` once the thread is to stop.
    pub(super) fn sleep_until(&self, until: Instant) -> Option<u32> {
        let mut st = self.shared.state.lock();
        while !st.stop && st.raised == 0 && Instant::now() < until {
            self.shared.wake.wait_until(&mut st, until);
        }
        if st.stop {
            return None;
        }
        Some(std::mem::take(&mut st.raised))
    }

    /// The client, for one round: `None` once it was dropped or closed.
    pub(super) fn client(&self) -> Option<Client> {
        let client = Client { inner: self.client.upgrade()? };
        (!client.is_closed()).then_some(client)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    #[test]
    fn a_raised_signal_wakes_the_sleeper_and_dropping_the_owner_stops_it() {
        let shared = Arc::new(Shared::default());
        let owner = Background { shared: Arc::clone(&shared) };
        let sleeper = Sleeper { shared, client: Weak::new() };
        // Nothing raised: the time passes.
        assert_eq!(sleeper.sleep_until(Instant::now() + Duration::from_millis(5)), Some(0));
        let (woke, wakes) = mpsc::channel();
        let thread = std::thread::spawn(move || loop {
            let raised = sleeper.sleep_until(Instant::now() + Duration::from_secs(600));
            woke.send(raised).unwrap();
            if raised.is_none() {
                return;
            }
        });
        let within = Duration::from_secs(10);
        owner.raise(0b10);
        assert_eq!(wakes.recv_timeout(within), Ok(Some(0b10)), "a signal wakes it");
        owner.raise(0b01);
        assert_eq!(wakes.recv_timeout(within), Ok(Some(0b01)), "each time");
        drop(owner);
        assert_eq!(wakes.recv_timeout(within), Ok(None), "dropping the owner stops it");
        thread.join().unwrap();
    }
}
