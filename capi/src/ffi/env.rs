//! `dmlc_open_env`: the device a job's environment names, read by
//! `dmlc_comm::rabit::Config` (the one reader of that environment).

use std::collections::HashMap;

use super::*;

/// Opens the device a job's environment names (`DMLC_SOCKET`,
/// `DMLC_SOCKET_PREFIX`, `DMLC_DEVICE`, `DMLC_POLL`, `DMLC_DMA_BYTES`) and
/// checks its rank and size against `DMLC_TASK_ID`/`RANK` and
/// `DMLC_NUM_WORKER`/`WORLD_SIZE`: `dmlc_comm::rabit::Config`, the one
/// reader of that environment.
///
/// # Safety
///
/// `env` is NULL (the process environment) or a NULL-terminated array of
/// NUL-terminated `NAME=VALUE` strings; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn dmlc_open_env(
    env: *const *const c_char,
    out: *mut *mut DmlcDevice,
) -> c_int {
    guard(|| {
        if out.is_null() {
            return Err(Fail::invalid("out is NULL"));
        }
        // SAFETY: `out` is non-NULL and writable per the contract.
        unsafe { out.write(std::ptr::null_mut()) };
        let cfg = if env.is_null() {
            Config::from_env()
        } else {
            // SAFETY: a NULL-terminated array of C strings per the contract.
            let vars = unsafe { env_array(env) }?;
            Config::from_lookup(|k| vars.get(k).cloned())
        }
        .map_err(env_fail)?;
        if cfg.transport != TransportKind::Device {
            return Err(Fail {
                status: DMLC_ERR_ENVIRONMENT,
                msg: "DMLC_TRANSPORT=tcp: this opens the device (the TCP baseline is the rabit \
                      API's, dmlc_rabit.h)"
                    .into(),
            });
        }
        let dev = rabit::open_device(&cfg).map_err(env_fail)?;
        // SAFETY: `out` is non-NULL and writable per the contract.
        unsafe { out.write(boxed_device(dev)) };
        Ok(())
    })
}

/// `NAME=VALUE` strings up to a NULL, as a map.
///
/// # Safety
///
/// `env` is a NULL-terminated array of NUL-terminated strings.
unsafe fn env_array(mut env: *const *const c_char) -> Result<HashMap<String, String>, Fail> {
    let mut vars = HashMap::new();
    loop {
        // SAFETY: each element up to the NULL is readable per the contract.
        let p = unsafe { env.read() };
        if p.is_null() {
            break;
        }
        // SAFETY: a NUL-terminated string per the contract.
        let entry = unsafe { CStr::from_ptr(p) }
            .to_str()
            .map_err(|_| Fail::invalid("an environment entry is not UTF-8"))?;
        let (k, v) = entry
            .split_once('=')
            .ok_or_else(|| Fail::invalid(format!("environment entry {entry:?} has no '='")))?;
        vars.insert(k.to_string(), v.to_string());
        // SAFETY: not past the terminating NULL, which ended the loop.
        env = unsafe { env.add(1) };
    }
    Ok(vars)
}

/// The status of a failure to open from the environment: the device's own
/// error where opening failed, DMLC_ERR_ENVIRONMENT for the settings.
fn env_fail(e: RabitError) -> Fail {
    match e {
        RabitError::Open { which, source } => {
            let mut f = Fail::from(source);
            f.msg = format!("cannot open the device ({which}): {}", f.msg);
            f
        }
        other => Fail {
            status: DMLC_ERR_ENVIRONMENT,
            msg: other.to_string(),
        },
    }
}

/// 1 if collectives reach the caller's own memory without a copy (the
/// kernel transport: `dmlc_wrap_memory` works), 0 if not, -1 if dev is NULL.
///
/// # Safety
///
/// `dev` is NULL or an open device.
#[no_mangle]
pub unsafe extern "C" fn dmlc_reaches_any_memory(dev: *const DmlcDevice) -> c_int {
    // SAFETY: forwarded contract.
    match unsafe { device(dev) } {
        Ok(d) => c_int::from(d.dev.is_kernel()),
        Err(_) => -1,
    }
}

/// Bytes per request of the host forms (`dmlc_*_host`), the same on every
/// member of a group: data longer than this is cut into pieces of this
/// size (allgather and reduce-scatter: of this size over `world_size`).
/// A client that sends device memory directly cuts at the same places,
/// so that its requests pair with those of a member that goes through the
/// host forms. 0 if dev is NULL.
///
/// # Safety
///
/// `dev` is NULL or an open device.
#[no_mangle]
pub unsafe extern "C" fn dmlc_host_chunk_bytes(dev: *const DmlcDevice) -> u64 {
    // SAFETY: forwarded contract.
    match unsafe { device(dev) } {
        Ok(d) => d
            .bounce
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .chunk_bytes() as u64,
        Err(_) => 0,
    }
}

/// Turns the check of non-finite inputs (spec 5.X.6.14) on (`on` != 0) or
/// off for `dev`'s later requests: a floating-point reduction whose inputs
/// hold a NaN or an infinity on any member then fails with
/// `DMLC_ERR_NONFINITE`, the rank in the completion's (and
/// `dmlc_last_error_completion`'s) `peer` and the element in
/// `dmlc_last_error_length`; the outputs hold the result all the same.
/// `DMLC_CHECK_FINITE=1` turns it on in `dmlc_open_env`.
/// `DMLC_ERR_INVALID_ARGUMENT` if the device lacks feature bit 4 (across
/// hosts, or over the kernel driver) or dev is NULL.
///
/// # Safety
///
/// `dev` is NULL or an open device.
#[no_mangle]
pub unsafe extern "C" fn dmlc_set_check_finite(dev: *const DmlcDevice, on: c_int) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let d = unsafe { device(dev) }?;
        d.dev.set_check_finite(on != 0)?;
        Ok(())
    })
}

/// Tags `dev`'s later collectives that name tag 0 with `tag` (0: none),
/// e.g. a trainer's step number, which `dmlc-ctl freeze --tag` can name
/// (docs/debugging.md); every member must set the same tag for a
/// collective (the device compares it). Sends, receives and
/// dmlc_comm_create keep their own tag. `DMLC_ERR_INVALID_ARGUMENT` if dev
/// is NULL.
///
/// # Safety
///
/// `dev` is NULL or an open device.
#[no_mangle]
pub unsafe extern "C" fn dmlc_set_tag(dev: *const DmlcDevice, tag: u64) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let d = unsafe { device(dev) }?;
        d.dev.set_tag(tag);
        Ok(())
    })
}

/// How waits spend their time on `dev`: `DMLC_WAIT_INTERRUPT`,
/// `DMLC_WAIT_POLL` or `DMLC_WAIT_HYBRID` (`Wait::code`); -1 if dev is NULL.
///
/// # Safety
///
/// `dev` is NULL or an open device.
#[no_mangle]
pub unsafe extern "C" fn dmlc_wait_mode(dev: *const DmlcDevice) -> c_int {
    // SAFETY: forwarded contract.
    match unsafe { device(dev) } {
        Ok(d) => d.dev.wait_mode().code(),
        Err(_) => -1,
    }
}
