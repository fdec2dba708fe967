//! Plumbing shared by the C APIs ([`crate::ffi`] and [`crate::ffi_rabit`]):
//! a failure on its way to C, the per-thread last error message, and the
//! guard that turns failures and panics into a status code. Each API keeps
//! its own message slot and status numbers.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::thread::LocalKey;

/// A thread's last error message of one C API.
pub(crate) type LastError = LocalKey<RefCell<CString>>;

/// A failure on its way to C: the status and the message.
pub(crate) struct Fail {
    pub(crate) status: c_int,
    pub(crate) msg: String,
}

/// Statuses of one C API that [`guard`] returns itself.
pub(crate) struct Codes {
    pub(crate) ok: c_int,
    pub(crate) internal: c_int,
}

fn set_last_error(slot: &'static LastError, msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    slot.with(|e| *e.borrow_mut() = c);
}

/// The message in `slot` ("" if none). The pointer stays valid until the
/// next failure on this thread replaces the thread-local string.
pub(crate) fn last_error_ptr(slot: &'static LastError) -> *const c_char {
    slot.with(|e| e.borrow().as_ptr())
}

/// Runs `f`, turning failures and panics into a status code; the message
/// of either goes to `slot`.
pub(crate) fn guard(
    slot: &'static LastError,
    codes: Codes,
    f: impl FnOnce() -> Result<(), Fail>,
) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => codes.ok,
        Ok(Err(fail)) => {
            set_last_error(slot, &fail.msg);
            fail.status
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            set_last_error(slot, &format!("internal error: {what}"));
            codes.internal
        }
    }
}

/// Runs `f` for a value, with `default` on a panic (no status to return).
pub(crate) fn guard_value<T>(default: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(default)
}
