//! Posting requests: [`Device::submit`] (checked first),
//! [`Device::submit_raw`] (unchecked), [`Device::call`] (post, then wait),
//! and the bound that every wait for a request gets.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use virtio_dmlc::comm::{CommOpcode, VirtioDmlcReqComm};
use virtio_dmlc::{VirtioDmlcReq, VIRTIO_DMLC_F_REQ_TIMEOUT, VIRTIO_RING_F_INDIRECT_DESC};

use crate::error::{Error, Result};

use super::collectives::standard_chain;
use super::open::{bit, Engine};
use super::queue::{post_locked, Header, PostCtx, Posted, QueueState};
use super::{BufSlice, Device, Done, Handle, RawDesc, Request, ASSUMED_DEFAULT_TIMEOUT};

impl Device {
    /// Posts a request after [`Self::check`]ing it; returns at once.
    /// Fails with [`Error::QueueFull`] if the queue has no room now.
    pub fn submit(
        &self,
        queue: u16,
        req: &Request,
        input: &[BufSlice],
        output: &[BufSlice],
    ) -> Result<Handle> {
        self.check(req, input, output)?;
        let chain = standard_chain(input, output);
        let header = self.header_of(req.header(), req.comm, &[]);
        self.post(queue, &header, &chain, false, None)
    }

    /// Posts `chain` with `header` in the header slot, unchecked; returns
    /// at once. For exercising the device's checks.
    pub fn submit_raw(
        &self,
        queue: u16,
        header: &VirtioDmlcReq,
        chain: &[RawDesc],
    ) -> Result<Handle> {
        if let Engine::Kernel(_) = self.engine {
            return Err(Error::InvalidArgument(
                "submit_raw needs the pci or host transport: the kernel driver builds every \
                 chain itself"
                    .into(),
            ));
        }
        self.post(queue, &self.header_of(*header, 0, &[]), chain, false, None)
    }

    /// The header this device's requests carry: with feature bit 1, the
    /// 48-byte one naming communicator `comm` (peer, key and table 0 and
    /// empty; see [`Device::comm_header`]); with the check of
    /// [`Device::set_check_finite`], `FLAG_CHECK_FINITE` set; a collective
    /// naming tag 0 gets the tag of [`Device::set_tag`].
    pub(super) fn header_of<'a>(
        &self,
        base: VirtioDmlcReq,
        comm: u32,
        table: &'a [u8],
    ) -> Header<'a> {
        let mut base = base;
        let tag = self.tag();
        let own_tag = [CommOpcode::Send, CommOpcode::Recv, CommOpcode::CommCreate]
            .iter()
            .any(|o| o.raw() == base.opcode.get());
        if tag != 0 && base.tag.get() == 0 && !own_tag {
            base.tag = tag.into();
        }
        if self.check_finite() {
            base.flags = (base.flags.get() | virtio_dmlc::FLAG_CHECK_FINITE).into();
        }
        if self.comms.is_none() {
            return Header::Base(base);
        }
        Header::Comm(
            VirtioDmlcReqComm {
                base,
                comm: comm.into(),
                peer: 0.into(),
                key: 0.into(),
                table_bytes: (table.len() as u32).into(),
            },
            table,
        )
    }

    /// Posts, waiting for room if the queue is full, then waits for the
    /// result. `timeout` bounds both.
    pub fn call(
        &self,
        queue: u16,
        req: &Request,
        input: &[BufSlice],
        output: &[BufSlice],
        timeout: Option<Duration>,
    ) -> Result<Done> {
        self.check(req, input, output)?;
        let chain = standard_chain(input, output);
        let header = self.header_of(req.header(), req.comm, &[]);
        self.call_chain(queue, &header, &chain, timeout)
    }

    /// Posts `chain` under `header`, waiting for room, then waits for the
    /// result; `timeout` bounds both. The caller has checked the request.
    pub(super) fn call_chain(
        &self,
        queue: u16,
        header: &Header<'_>,
        chain: &[RawDesc],
        timeout: Option<Duration>,
    ) -> Result<Done> {
        let deadline = timeout.map(|t| Instant::now() + t);
        if let Engine::Kernel(k) = &self.engine {
            // One system call: submit and wait, within the wait's bound.
            let after = self.wait_bound(header.base());
            let bound = Instant::now() + after;
            let limit = deadline.map_or(bound, |d| d.min(bound));
            let leases = self.leases(chain)?;
            let (_, done) = k.submit(queue, header, chain, leases, Some(Some(limit)))?;
            return match done.expect("a waiting submit reports its outcome") {
                Err(Error::WaitTimeout) if deadline.is_none_or(|d| d > bound) => {
                    Err(Error::Unanswered { after })
                }
                r => r,
            };
        }
        let h = self.post(queue, header, chain, true, deadline)?;
        self.wait_deadline(h, deadline)
    }

    /// The effective timeout of a request with this header, as far as the
    /// driver can know it, plus [`WAIT_MARGIN`](super::WAIT_MARGIN).
    fn wait_bound(&self, header: &VirtioDmlcReq) -> Duration {
        let ms = header.timeout_ms.get();
        let timeout = if ms != 0 && self.features & bit(VIRTIO_DMLC_F_REQ_TIMEOUT) != 0 {
            Duration::from_millis(u64::from(ms))
        } else {
            ASSUMED_DEFAULT_TIMEOUT
        };
        timeout + self.wait_margin
    }

    pub(super) fn post(
        &self,
        queue: u16,
        header: &Header<'_>,
        chain: &[RawDesc],
        block: bool,
        deadline: Option<Instant>,
    ) -> Result<Handle> {
        if let Engine::Kernel(k) = &self.engine {
            let leases = self.leases(chain)?;
            return Ok(k.submit(queue, header, chain, leases, None)?.0);
        }
        let q = self.queue(queue)?;
        let leases = self.leases(chain)?;
        let mut keep = Some(leases);
        let after = self.wait_bound(header.base());
        let ctx = PostCtx {
            mem: &self.mem,
            indirect: self.features & bit(VIRTIO_RING_F_INDIRECT_DESC) != 0,
            comm: self.comms.is_some(),
            posted: Posted {
                generation: self.known_generation.load(Ordering::Relaxed),
                group: self.known_group.load(Ordering::Relaxed),
                confirmed: false,
            },
            after,
        };
        let (handle, notify) = if block {
            // Room appears when a request completes; if none of those in
            // flight completes within its own bound, the device is stuck.
            let mut room_bound: Option<(Instant, Duration)> = None;
            self.wait_until(
                q,
                deadline,
                &mut |st: &mut QueueState| match post_locked(
                    st, q.index, header, chain, &mut keep, &ctx,
                ) {
                    Err(Error::QueueFull) => {
                        let (until, after) = *room_bound.get_or_insert_with(|| {
                            st.in_flight
                                .iter()
                                .flatten()
                                .map(|r| (r.bound, r.after))
                                .max()
                                .unwrap_or((Instant::now() + after, after))
                        });
                        if Instant::now() >= until {
                            return Err(Error::Unanswered { after });
                        }
                        Ok(None)
                    }
                    r => r.map(Some),
                },
                None,
            )?
        } else {
            let mut st = q.lock();
            let posted = post_locked(&mut st, q.index, header, chain, &mut keep, &ctx);
            q.release(st);
            posted?
        };
        if notify {
            self.transport.notify(q.index)?;
        }
        Ok(handle)
    }
}
