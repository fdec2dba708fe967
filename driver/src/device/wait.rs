//! Waiting for completions: [`Device::wait`] and [`Device::is_done`], the
//! wait loop that posting shares (busy-poll, the hybrid wait's spin, or a
//! sleep on the interrupt; bounded by the request's own timeout), and the
//! looks at the config space that notice a restarted device.

use std::time::{Duration, Instant};

use crate::error::{Error, Result};

use super::open::Engine;
use super::queue::{completion_result, in_flight_of, Posted, Queue, QueueState};
use super::{Device, Done, Handle, ASSUMED_DEFAULT_TIMEOUT};

/// How often a polling waiter checks that the device is still there.
const ALIVE_CHECK: Duration = Duration::from_millis(10);
/// A wait that has lasted this long starts watching the config space for a
/// changed generation or group id ...
const WATCH_AFTER: Duration = Duration::from_millis(1);
/// ... and looks again after this long, then after twice as long each time
/// up to [`WATCH_EVERY_MAX`]. A look is a config read: a GET_CONFIG round
/// trip to the backend on both transports (on PCI, through QEMU), which in
/// a TCG guest costs the vCPU a few hundred microseconds. With a look
/// every 5 ms, a TCG rank sleeping on interrupts for a peer 50 ms late was
/// on its vCPU 10.4% of the wait, with the back-off 7.8% (medians,
/// docs/benchmarks-journal.md). A restarted backend (the one thing the look finds)
/// is rare, and is still found within this bound.
const WATCH_EVERY: Duration = Duration::from_millis(5);
/// The longest time between two looks at the config space in one wait.
const WATCH_EVERY_MAX: Duration = Duration::from_millis(80);

/// A look at the device a long wait takes now and then (see `wait_until`).
type WatchFn<'a> = &'a mut dyn FnMut(&Queue) -> Result<()>;

impl Device {
    /// Waits for a posted request. `None`: no limit of the caller's; the
    /// wait still ends, with [`Error::Unanswered`], once the request's own
    /// timeout plus [`WAIT_MARGIN`] has passed (the device's default timeout
    /// counts as [`ASSUMED_DEFAULT_TIMEOUT`]), and with
    /// [`Error::RequestDropped`] when the device's group id changes while
    /// the request stays in flight.
    ///
    /// [`WAIT_MARGIN`]: super::WAIT_MARGIN
    pub fn wait(&self, h: Handle, timeout: Option<Duration>) -> Result<Done> {
        self.wait_deadline(h, timeout.map(|t| Instant::now() + t))
    }

    pub(super) fn wait_deadline(&self, h: Handle, deadline: Option<Instant>) -> Result<Done> {
        if let Engine::Kernel(k) = &self.engine {
            // The module keeps no per-request bound: the longest a request
            // can take is its timeout (at most the assumed default) plus
            // the margin, counted from now as the request's posting time
            // is the module's.
            let bound = Instant::now() + ASSUMED_DEFAULT_TIMEOUT + self.wait_margin;
            return match k.wait(h, Some(deadline.map_or(bound, |d| d.min(bound)))) {
                Err(Error::WaitTimeout) if deadline.is_none_or(|d| d > bound) => {
                    Err(Error::Unanswered {
                        after: ASSUMED_DEFAULT_TIMEOUT + self.wait_margin,
                    })
                }
                r => r,
            };
        }
        let q = self.queue(h.queue)?;
        let bound = {
            let st = q.lock();
            match &st.in_flight[usize::from(h.head)] {
                Some(r) if r.serial == h.serial => Some((r.bound, r.after)),
                _ => None, // completed already, or unknown: `ready` tells
            }
        };
        let (limit, unanswered) = match (deadline, bound) {
            (Some(d), Some((b, after))) if b < d => (Some(b), Some(after)),
            (None, Some((b, after))) => (Some(b), Some(after)),
            (d, _) => (d, None),
        };
        let mut watch = |q: &Queue| self.watch(q, h);
        let c = self.wait_until(
            q,
            limit,
            &mut |st: &mut QueueState| {
                if let Some(c) = st.done.remove(&h.serial) {
                    return Ok(Some(c));
                }
                match &st.in_flight[usize::from(h.head)] {
                    Some(r) if r.serial == h.serial => Ok(None),
                    _ => Err(Error::UnknownHandle),
                }
            },
            Some(&mut watch),
        );
        match (c, unanswered) {
            (Err(Error::WaitTimeout), Some(after)) => Err(Error::Unanswered { after }),
            (c, _) => completion_result(&c?),
        }
    }

    /// One look at the config space for a waiter of `h` (spec 5.X.7.4): if
    /// the group id differs from the one the request was posted under, the
    /// device implementation restarted; a request still in flight after
    /// draining the ring once more was dropped and will never complete.
    fn watch(&self, q: &Queue, h: Handle) -> Result<()> {
        let (generation, group) = self.read_group()?;
        let mut st = q.lock();
        let mut verdict = Ok(());
        // Only a new group id: a new generation alone either failed the
        // request (it is in the used ring) or came before the device took
        // it (it completes by matching or by timeout). A member that was
        // itself lost learns it from its transport (device reset, DRIVER_OK
        // cleared, connection closed).
        let changed = match in_flight_of(&mut st, h) {
            Some(r) if r.posted.group == group => {
                r.posted.confirmed = true;
                false
            }
            Some(_) => true,
            None => false,
        };
        if changed {
            verdict = st.harvest();
            if verdict.is_ok() {
                if let Some(r) = in_flight_of(&mut st, h) {
                    let was = r.posted;
                    if was.confirmed {
                        verdict = Err(Error::RequestDropped {
                            generation: (was.generation, generation),
                            group: (was.group, group),
                        });
                    } else {
                        // What the driver knew at posting may have been stale
                        // (the change may predate the request): from now on
                        // the request is known to be in this generation.
                        r.posted = Posted {
                            generation,
                            group,
                            confirmed: true,
                        };
                    }
                }
            }
        }
        q.release(st);
        verdict
    }

    /// True if the request has completed (its result waits in [`Self::wait`]).
    pub fn is_done(&self, h: Handle) -> Result<bool> {
        if let Engine::Kernel(k) = &self.engine {
            return k.is_done(h);
        }
        let q = self.queue(h.queue)?;
        let mut st = q.lock();
        st.harvest()?;
        let done = st.done.contains_key(&h.serial);
        q.release(st);
        Ok(done)
    }

    /// Runs `ready` under the queue lock, after collecting completions, until
    /// it returns `Some`. Poll mode spins; interrupt mode lets one thread
    /// sleep on the transport while the others wait for it on a condvar.
    /// `watch`, if given, runs without the lock once the wait has lasted
    /// [`WATCH_AFTER`], then after [`WATCH_EVERY`], backing off to
    /// [`WATCH_EVERY_MAX`]; its error ends the wait.
    pub(super) fn wait_until<R>(
        &self,
        q: &Queue,
        deadline: Option<Instant>,
        ready: &mut dyn FnMut(&mut QueueState) -> Result<Option<R>>,
        mut watch: Option<WatchFn<'_>>,
    ) -> Result<R> {
        let started = Instant::now();
        let mut last_check = started;
        let mut next_watch = started + WATCH_AFTER;
        let mut watch_every = WATCH_EVERY;
        let mut spins = 0u32;
        let hybrid = self.spin.is_hybrid();
        let budget = self.spin.budget_for_next_wait();
        let spin_until = started + budget;
        loop {
            let mut st = q.lock();
            st.harvest()?;
            if let Some(r) = ready(&mut st)? {
                q.release(st);
                if hybrid {
                    self.spin.learn(budget, started.elapsed());
                }
                return Ok(r);
            }
            let now = Instant::now();
            let mut remaining = match deadline {
                Some(d) if now >= d => {
                    q.release(st);
                    return Err(Error::WaitTimeout);
                }
                Some(d) => Some(d - now),
                None => None,
            };
            if now.duration_since(last_check) >= ALIVE_CHECK {
                last_check = now;
                if let Err(e) = self.transport.check_alive() {
                    q.release(st);
                    return self.last_look(q, ready, e.into());
                }
            }
            if let Some(w) = watch.as_mut() {
                if now >= next_watch {
                    q.release(st);
                    if let Err(e) = w(q) {
                        return self.last_look(q, ready, e);
                    }
                    next_watch = Instant::now() + watch_every;
                    watch_every = (watch_every * 2).min(WATCH_EVERY_MAX);
                    continue;
                }
                // Sleep no longer than until the next look.
                let until = next_watch - now;
                remaining = Some(remaining.map_or(until, |r| r.min(until)));
            }
            if self.poll || (hybrid && now < spin_until) {
                // Interrupts stay off while spinning (the hybrid wait arms
                // them only to sleep, and takes them off again after).
                q.release(st);
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(128) {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            } else if st.sleeping {
                // Another thread sleeps on the interrupt and will wake us
                // when it has collected completions.
                if std::mem::take(&mut st.wake) {
                    q.cond.notify_all();
                }
                let limit = remaining.map_or(ALIVE_CHECK, |r| r.min(ALIVE_CHECK));
                drop(q.cond.wait_timeout(st, limit));
            } else {
                st.sleeping = true;
                let pending = st.vq.arm_interrupt();
                q.release(st);
                let woke = if pending {
                    Ok(true)
                } else {
                    self.transport.wait_interrupt(q.index, remaining)
                };
                {
                    let mut st = q.lock();
                    st.sleeping = false;
                    if hybrid {
                        st.vq.set_interrupts(false);
                    }
                }
                q.cond.notify_all();
                if let Err(e) = woke {
                    return self.last_look(q, ready, e.into());
                }
            }
        }
    }

    /// The wait ends with `err` (the device is gone, or the request was
    /// dropped) unless the used ring already holds the answer: a device
    /// that completed the request and then went away (an orderly stop
    /// resets the group, then closes) answered it.
    fn last_look<R>(
        &self,
        q: &Queue,
        ready: &mut dyn FnMut(&mut QueueState) -> Result<Option<R>>,
        err: Error,
    ) -> Result<R> {
        let mut st = q.lock();
        let found = st.harvest().and_then(|()| ready(&mut st));
        q.release(st);
        match found {
            Ok(Some(r)) => Ok(r),
            _ => Err(err),
        }
    }
}
