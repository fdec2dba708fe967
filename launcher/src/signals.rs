//! SIGINT, SIGTERM and SIGHUP set a flag that the launcher polls, so that
//! every exit path goes through the same teardown (VMs, backend, temp dir).

use std::sync::atomic::{AtomicI32, Ordering};

use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};

/// The last stopping signal received, 0 if none.
static RECEIVED: AtomicI32 = AtomicI32::new(0);

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum SignalError {
    #[error("cannot install the handler for {0}")]
    Install(Signal, #[source] nix::Error),
}

extern "C" fn on_signal(sig: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    RECEIVED.store(sig, Ordering::SeqCst);
}

/// Installs the handlers (once, at start).
pub fn install() -> Result<(), SignalError> {
    let action = SigAction::new(
        SigHandler::Handler(on_signal),
        SaFlags::SA_RESTART,
        SigSet::empty(),
    );
    for sig in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
        // SAFETY: the handler only stores into an atomic, which is
        // async-signal-safe, and replaces no handler that Rust code relies on.
        unsafe { sigaction(sig, &action) }.map_err(|e| SignalError::Install(sig, e))?;
    }
    Ok(())
}

/// The stopping signal received so far, if any.
pub fn received() -> Option<i32> {
    match RECEIVED.load(Ordering::SeqCst) {
        0 => None,
        sig => Some(sig),
    }
}

/// Name of a signal number, for messages.
pub fn name(sig: i32) -> String {
    Signal::try_from(sig)
        .map(|s| s.as_str().to_owned())
        .unwrap_or_else(|_| format!("signal {sig}"))
}
