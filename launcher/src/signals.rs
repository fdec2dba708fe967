//! SIGINT, SIGTERM and SIGHUP set a flag that the launcher polls, so that
//! every exit path goes through the same teardown (VMs, backend, temp dir).

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};

use nix::sys::signal::Signal;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM, SIGUSR1};

/// The last stopping signal received, 0 if none.
static RECEIVED: LazyLock<Arc<AtomicUsize>> = LazyLock::new(|| Arc::new(AtomicUsize::new(0)));

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum SignalError {
    #[error("cannot install the handler for {}", name(*.0))]
    Install(i32, #[source] io::Error),
}

/// Installs the handlers (once, at start); with `usr1`, SIGUSR1 stops too.
pub fn install(usr1: bool) -> Result<(), SignalError> {
    let extra: &[i32] = if usr1 { &[SIGUSR1] } else { &[] };
    for &sig in [SIGINT, SIGTERM, SIGHUP].iter().chain(extra) {
        // Each stores its own number: the launcher reports which one came.
        signal_hook::flag::register_usize(sig, Arc::clone(&RECEIVED), sig as usize)
            .map_err(|e| SignalError::Install(sig, e))?;
    }
    Ok(())
}

/// The stopping signal received so far, if any.
pub fn received() -> Option<i32> {
    match RECEIVED.load(Ordering::SeqCst) {
        0 => None,
        sig => i32::try_from(sig).ok(),
    }
}

/// Name of a signal number, for messages.
pub fn name(sig: i32) -> String {
    Signal::try_from(sig)
        .map(|s| s.as_str().to_owned())
        .unwrap_or_else(|_| format!("signal {sig}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signal_is_recorded_not_fatal() {
        install(false).unwrap();
        assert_eq!(received(), None);
        signal_hook::low_level::raise(SIGHUP).unwrap();
        assert_eq!(received(), Some(SIGHUP));
        assert_eq!(name(SIGHUP), "SIGHUP");
        assert_eq!(name(0), "signal 0");
    }
}
