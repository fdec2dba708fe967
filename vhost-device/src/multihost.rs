//! The daemons of several hosts as one MPI job (`--mpi`, feature `mpi`).
//!
//! One thread, `dmlc-mpi`, initialises MPI, agrees on the group id (host
//! 0's, broadcast) and then makes every MPI call of the daemon: it runs the
//! engine's inter-host stage ([`crate::group::remote::serve`]) over
//! [`MpiExchange`]. Asking for `MPI_THREAD_FUNNELED` is enough for that (the
//! thread that initialised MPI is the only one that calls it).
//!
//! Every wait is bounded: collectives are started non-blocking
//! (`MPI_Iallgather`, `MPI_Ibcast`) and tested until done or until their
//! deadline; the communicator returns errors (`MPI_ERRORS_RETURN`) instead
//! of ending the process. MPI cannot cancel a collective, so after a missed
//! deadline or an error the exchange is unusable: the engine fails what is
//! pending and the job ends with `MPI_Abort`. The data of a collective is
//! staged in buffers of the exchange, so that one left to MPI after a
//! missed deadline stays valid (it is leaked) until the process ends.

use std::os::raw::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use mpi::ffi;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::AsRaw;
use mpi::Threading;

use crate::group::remote::{self, Exchange, ExchangeError, Pieces, RemoteLink, NEWS_BYTES};

/// The tag of news between the daemons (point to point on
/// `MPI_COMM_WORLD`, which never matches a collective).
const NEWS_TAG: c_int = 16;

/// Largest message per host of one MPI call (the count is a C int).
const CHUNK: usize = 256 << 20;

/// How long the daemons wait for each other at start.
const START_WAIT: Duration = Duration::from_secs(120);

/// Who this daemon is in the job.
#[derive(Clone, Copy, Debug)]
pub struct Joined {
    pub host: u32,
    pub hosts: u32,
    /// Host 0's group id.
    pub group_id: u64,
    /// Host 0's `--mpi-piece`: bytes per host of one piece of a pipelined
    /// exchange.
    pub piece: usize,
}

/// Tells when the `dmlc-mpi` thread has finalised MPI (after
/// [`RemoteLink::stop`]).
pub struct Finished(mpsc::Receiver<()>);

impl Finished {
    /// Waits up to `bound` for the thread to finalise MPI; false if it did
    /// not (`MPI_Finalize` waits for every daemon of the job, and one may be
    /// gone) or gave up serving on an error (then it called `MPI_Abort`).
    pub fn wait(&self, bound: Duration) -> bool {
        self.0.recv_timeout(bound).is_ok()
    }
}

/// Starts the `dmlc-mpi` thread: MPI is initialised there, host 0's group
/// id and piece size are agreed, and the thread then serves the steps sent
/// on the returned link until it is stopped.
pub fn start(group_id: u64, piece: usize) -> Result<(Joined, RemoteLink, Finished), String> {
    let (tx, rx) = mpsc::channel::<remote::Work>();
    let abandon = Arc::new(AtomicBool::new(false));
    let abandon_mpi = abandon.clone();
    let (joined_tx, joined_rx) = mpsc::channel::<Result<Joined, String>>();
    let (finished_tx, finished_rx) = mpsc::channel::<()>();
    thread::Builder::new()
        .name("dmlc-mpi".into())
        .spawn(move || {
            let mut ex = match MpiExchange::init(group_id, piece, abandon_mpi) {
                Ok((ex, joined)) => {
                    let _ = joined_tx.send(Ok(joined));
                    ex
                }
                Err(e) => {
                    let _ = joined_tx.send(Err(e));
                    return;
                }
            };
            remote::serve(&rx, &mut ex);
            log::info!("inter-host stage stopped; finalising MPI");
            // MPI_Finalize, which mpirun expects of every process it started
            // before it exits (else it reports the job as ended improperly).
            drop(ex);
            let _ = finished_tx.send(());
        })
        .map_err(|e| format!("cannot start the MPI thread: {e}"))?;
    let joined = joined_rx
        .recv()
        .map_err(|_| "the MPI thread ended before MPI was initialised".to_owned())??;
    Ok((
        joined,
        RemoteLink {
            host: joined.host,
            hosts: joined.hosts,
            tx,
            abandon,
        },
        Finished(finished_rx),
    ))
}

/// MPI between the daemons: one per host, `MPI_COMM_WORLD`'s rank is the
/// host index.
pub struct MpiExchange {
    world: SimpleCommunicator,
    host: u32,
    hosts: u32,
    send: Vec<u8>,
    recv: Vec<u8>,
    /// Bytes per host of one piece of [`Exchange::allgather_pieces`].
    piece: usize,
    /// Its two sets of staging buffers (one piece on the network while
    /// the other is produced or consumed).
    slots: [Slot; 2],
    /// The posted receive of news from any host, and its buffer (boxed:
    /// MPI writes it until the request completes).
    news_req: ffi::MPI_Request,
    news_buf: Box<[u8; NEWS_BYTES]>,
    /// News sends not known complete yet, with their buffers.
    news_sent: Vec<(ffi::MPI_Request, Box<[u8; NEWS_BYTES]>)>,
    /// Set when the group is reset: a wait gives up.
    abandon: Arc<AtomicBool>,
    /// Finalises MPI when dropped (the serve loop ended in order).
    _universe: mpi::environment::Universe,
}

/// How [`MpiExchange::wait`] waits.
#[derive(Clone, Copy)]
enum Wait {
    /// For the other hosts' members (a step's entries).
    Peers,
    /// For bytes on the network (data, the members' inputs all arrived).
    Data,
}

impl Wait {
    /// For a plain all-gather or broadcast of `n` bytes per host: a small
    /// one is most likely a step's entries (or the start), waiting for the
    /// other hosts; a large one is a collective's data.
    fn for_bytes(n: usize) -> Wait {
        if n <= 64 << 10 {
            Wait::Peers
        } else {
            Wait::Data
        }
    }
}

/// Staging buffers of one piece: this host's bytes, every host's bytes.
#[derive(Default)]
struct Slot {
    send: Vec<u8>,
    recv: Vec<u8>,
}

/// While a piece is on the network, the next one is produced (and the last
/// one consumed) in stretches of this many bytes at most (a quarter of a
/// smaller piece), with an `MPI_Test` between them: the test is what moves
/// the piece on (Open MPI's TCP transport progresses only inside MPI
/// calls).
const STRETCH: usize = 128 << 10;

/// The stretch for pieces of `piece` bytes: on 64-byte boundaries.
fn stretch(piece: usize) -> usize {
    (piece / 4).clamp(64, STRETCH) & !63
}

impl MpiExchange {
    fn init(
        group_id: u64,
        piece: usize,
        abandon: Arc<AtomicBool>,
    ) -> Result<(MpiExchange, Joined), String> {
        let (universe, granted) = mpi::initialize_with_threading(Threading::Funneled)
            .ok_or("MPI was initialised already")?;
        if granted < Threading::Funneled {
            log::warn!(
                "MPI granted thread level {granted:?} only; every MPI call is made from one \
                 thread (dmlc-mpi), which the library must tolerate"
            );
        }
        let world = universe.world();
        // SAFETY: `world` is a valid communicator of an initialised MPI, and
        // MPI_ERRORS_RETURN a predefined error handler.
        let rc = unsafe { ffi::MPI_Comm_set_errhandler(world.as_raw(), ffi::RSMPI_ERRORS_RETURN) };
        if rc != 0 {
            return Err(format!("MPI_Comm_set_errhandler failed ({rc})"));
        }
        let host = world.rank() as u32;
        let hosts = world.size() as u32;
        let mut ex = MpiExchange {
            world,
            host,
            hosts,
            send: Vec::new(),
            recv: Vec::new(),
            piece,
            slots: Default::default(),
            // SAFETY: a predefined handle, read only.
            news_req: unsafe { ffi::RSMPI_REQUEST_NULL },
            news_buf: Box::new([0; NEWS_BYTES]),
            news_sent: Vec::new(),
            abandon,
            _universe: universe,
        };
        ex.post_news()
            .map_err(|e| format!("cannot post the news receive: {e}"))?;
        let mut agreed = [0u8; 16];
        agreed[..8].copy_from_slice(&group_id.to_le_bytes());
        agreed[8..].copy_from_slice(&(piece as u64).to_le_bytes());
        ex.broadcast(&mut agreed, 0, Instant::now() + START_WAIT)
            .map_err(|e| format!("cannot agree on the group id: {e}"))?;
        let [id, piece] = [0, 8].map(|at| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&agreed[at..at + 8]);
            u64::from_le_bytes(b)
        });
        let (group_id, piece) = (id, piece as usize);
        ex.piece = piece;
        log::info!(
            "MPI: host {host} of {hosts} (thread level {granted:?}), group id {group_id:#x}"
        );
        Ok((
            ex,
            Joined {
                host,
                hosts,
                group_id,
                piece,
            },
        ))
    }

    /// Tests `req` until it completes or `deadline` passes. After a miss or
    /// an error the staging buffers are leaked: MPI may still write them.
    ///
    /// `Wait::Peers` (the other hosts' members may take long to arrive)
    /// sleeps between tests after a short spin; `Wait::Data` (bytes on the
    /// network) never sleeps, only yields: Open MPI's TCP transport moves
    /// a message on only inside MPI calls, a socket buffer at a time, so a
    /// sleep between tests stalls the transfer (a 16 MiB exchange took
    /// 8.7x the time of MPI_Allreduce alone with 50 us sleeps).
    fn wait(
        &mut self,
        mut req: ffi::MPI_Request,
        deadline: Instant,
        how: Wait,
    ) -> Result<(), ExchangeError> {
        let started = Instant::now();
        let mut spins = 0u32;
        loop {
            let mut flag: c_int = 0;
            // SAFETY: `req` is an active request of this thread's MPI; the
            // flag is ours; MPI_STATUS_IGNORE is a predefined sentinel.
            let rc = unsafe { ffi::MPI_Test(&mut req, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
            if rc != 0 {
                self.leak();
                return Err(ExchangeError::Failed(format!("MPI_Test failed ({rc})")));
            }
            if flag != 0 {
                return Ok(());
            }
            if Instant::now() >= deadline {
                self.leak();
                return Err(ExchangeError::Deadline(started.elapsed()));
            }
            if self.abandon.load(Ordering::Acquire) {
                self.leak();
                return Err(ExchangeError::Abandoned);
            }
            spins += 1;
            match how {
                Wait::Peers if spins > 1000 => thread::sleep(Duration::from_micros(50)),
                Wait::Data if spins.is_multiple_of(64) => thread::yield_now(),
                _ => std::hint::spin_loop(),
            }
        }
    }

    /// One `MPI_Test` of `req` (null once it completed): whether it is done.
    fn test(&mut self, req: &mut ffi::MPI_Request) -> Result<bool, ExchangeError> {
        let mut flag: c_int = 0;
        // SAFETY: `req` is an active or null request of this thread's MPI;
        // the flag is ours; MPI_STATUS_IGNORE is a predefined sentinel.
        let rc = unsafe { ffi::MPI_Test(req, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
        if rc != 0 {
            self.leak();
            return Err(ExchangeError::Failed(format!("MPI_Test failed ({rc})")));
        }
        Ok(flag != 0)
    }

    /// Starts the all-gather of the first `n` bytes of slot `s`'s `send`
    /// into its `recv` (`hosts * n` bytes, host after host).
    fn start_piece(&mut self, s: usize, n: usize) -> Result<ffi::MPI_Request, ExchangeError> {
        let slot = &mut self.slots[s];
        // SAFETY: a predefined handle, read only.
        let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: the slot's buffers hold at least `n` and `hosts * n`
        // bytes and stay allocated, untouched, until the request completes
        // (or are leaked with the exchange); the datatype and communicator
        // are valid; `req` is ours.
        let rc = unsafe {
            ffi::MPI_Iallgather(
                slot.send.as_ptr().cast(),
                count(n),
                ffi::RSMPI_UINT8_T,
                slot.recv.as_mut_ptr().cast(),
                count(n),
                ffi::RSMPI_UINT8_T,
                self.world.as_raw(),
                &mut req,
            )
        };
        if rc != 0 {
            // The other slot may still be on the network.
            self.leak();
            return Err(ExchangeError::Failed(format!(
                "MPI_Iallgather failed ({rc})"
            )));
        }
        Ok(req)
    }

    /// Hands every host's bytes of the piece at `at` (`n` per host, in slot
    /// `s`) to `pieces`, a stretch at a time, testing `next` (the piece
    /// on the network now, if any) between stretches.
    fn consume_piece(
        &mut self,
        pieces: &mut dyn Pieces,
        s: usize,
        at: usize,
        n: usize,
        next: &mut ffi::MPI_Request,
    ) -> Result<(), ExchangeError> {
        let hosts = self.hosts as usize;
        let stretch = stretch(self.piece);
        let mut off = 0;
        while off < n {
            let k = stretch.min(n - off);
            let recv = &self.slots[s].recv;
            let parts: Vec<&[u8]> = (0..hosts)
                .map(|h| &recv[h * n + off..h * n + off + k])
                .collect();
            pieces.consume(at + off, &parts);
            off += k;
            self.test(next)?;
        }
        Ok(())
    }

    /// Posts the receive of the next news from any host.
    fn post_news(&mut self) -> Result<(), ExchangeError> {
        // SAFETY: the boxed buffer holds NEWS_BYTES and lives in `self`
        // until the request completes (or is leaked with the exchange);
        // the datatype, source wildcard and communicator are valid.
        let rc = unsafe {
            ffi::MPI_Irecv(
                self.news_buf.as_mut_ptr().cast(),
                NEWS_BYTES as c_int,
                ffi::RSMPI_UINT8_T,
                ffi::RSMPI_ANY_SOURCE,
                NEWS_TAG,
                self.world.as_raw(),
                &mut self.news_req,
            )
        };
        if rc != 0 {
            return Err(ExchangeError::Failed(format!("MPI_Irecv failed ({rc})")));
        }
        Ok(())
    }

    fn leak(&mut self) {
        std::mem::forget(std::mem::take(&mut self.send));
        std::mem::forget(std::mem::take(&mut self.recv));
        std::mem::forget(std::mem::take(&mut self.slots));
    }
}

impl Drop for MpiExchange {
    /// Cancels the posted news receive before MPI is finalised (after the
    /// struct's fields, `_universe` last).
    fn drop(&mut self) {
        // SAFETY: a predefined handle, read only.
        let null = unsafe { ffi::RSMPI_REQUEST_NULL };
        if self.news_req == null {
            return;
        }
        // SAFETY: the posted receive is an active request of this thread's
        // MPI; cancelling a receive completes locally, so the wait returns.
        unsafe {
            ffi::MPI_Cancel(&mut self.news_req);
            ffi::MPI_Wait(&mut self.news_req, ffi::RSMPI_STATUS_IGNORE);
        }
    }
}

fn count(n: usize) -> c_int {
    c_int::try_from(n).expect("chunks fit a C int")
}

impl Exchange for MpiExchange {
    fn host(&self) -> u32 {
        self.host
    }

    fn hosts(&self) -> u32 {
        self.hosts
    }

    fn allgather(
        &mut self,
        mine: &[u8],
        all: &mut [u8],
        deadline: Instant,
    ) -> Result<(), ExchangeError> {
        let len = mine.len();
        let hosts = self.hosts as usize;
        assert_eq!(all.len(), hosts * len, "allgather output size");
        let mut off = 0;
        while off < len || (len == 0 && off == 0) {
            let n = CHUNK.min(len - off);
            self.send.clear();
            self.send.extend_from_slice(&mine[off..off + n]);
            self.recv.resize(hosts * n, 0);
            // SAFETY: a predefined handle, read only.
            let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
            // SAFETY: the staging buffers hold `n` and `hosts * n` bytes and
            // stay allocated until the request completes (or are leaked);
            // the datatype and communicator are valid; `req` is ours.
            let rc = unsafe {
                ffi::MPI_Iallgather(
                    self.send.as_ptr().cast(),
                    count(n),
                    ffi::RSMPI_UINT8_T,
                    self.recv.as_mut_ptr().cast(),
                    count(n),
                    ffi::RSMPI_UINT8_T,
                    self.world.as_raw(),
                    &mut req,
                )
            };
            if rc != 0 {
                return Err(ExchangeError::Failed(format!(
                    "MPI_Iallgather failed ({rc})"
                )));
            }
            self.wait(req, deadline, Wait::for_bytes(n))?;
            for h in 0..hosts {
                all[h * len + off..h * len + off + n]
                    .copy_from_slice(&self.recv[h * n..(h + 1) * n]);
            }
            off += n;
            if len == 0 {
                break;
            }
        }
        Ok(())
    }

    /// Two slots: while piece k is on the network, piece k+1 is produced
    /// into the other slot, then piece k is consumed while k+1 travels.
    fn allgather_pieces(
        &mut self,
        len: usize,
        pieces: &mut dyn Pieces,
        deadline: Instant,
    ) -> Result<(), ExchangeError> {
        let hosts = self.hosts as usize;
        let piece = self.piece.min(len.max(1));
        for slot in &mut self.slots {
            slot.send.resize(piece, 0);
            slot.recv.resize(hosts * piece, 0);
        }
        // SAFETY: a predefined handle, read only.
        let null = unsafe { ffi::RSMPI_REQUEST_NULL };
        // The piece on the network: its slot, offset, length and request.
        let mut flying: Option<(usize, usize, usize, ffi::MPI_Request)> = None;
        // Time spent producing, waiting for a piece, consuming (logged).
        let mut spent = [Duration::ZERO; 3];
        let mut at = 0;
        let mut k = 0;
        while at < len || flying.is_some() {
            let mut next = null;
            let mut started = None;
            if at < len {
                let n = piece.min(len - at);
                let s = k % 2;
                let t = Instant::now();
                let mut off = 0;
                while off < n {
                    let m = stretch(self.piece).min(n - off);
                    pieces.produce(at + off, &mut self.slots[s].send[off..off + m]);
                    off += m;
                    if let Some((.., req)) = &mut flying {
                        self.test(req)?;
                    }
                }
                spent[0] += t.elapsed();
                next = self.start_piece(s, n)?;
                started = Some((s, at, n));
                at += n;
                k += 1;
            }
            if let Some((s, p_at, n, req)) = flying.take() {
                let t = Instant::now();
                self.wait(req, deadline, Wait::Data)?;
                spent[1] += t.elapsed();
                let t = Instant::now();
                self.consume_piece(pieces, s, p_at, n, &mut next)?;
                spent[2] += t.elapsed();
            }
            if let Some((s, p_at, n)) = started {
                flying = Some((s, p_at, n, next));
            }
        }
        log::debug!(
            "{len} bytes in {k} pieces: producing {:?}, waiting {:?}, consuming {:?}",
            spent[0],
            spent[1],
            spent[2]
        );
        Ok(())
    }

    fn broadcast(
        &mut self,
        buf: &mut [u8],
        root: u32,
        deadline: Instant,
    ) -> Result<(), ExchangeError> {
        let len = buf.len();
        let mut off = 0;
        while off < len {
            let n = CHUNK.min(len - off);
            self.recv.clear();
            self.recv.extend_from_slice(&buf[off..off + n]);
            // SAFETY: a predefined handle, read only.
            let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
            // SAFETY: as in allgather: the staging buffer holds `n` bytes
            // and outlives the request.
            let rc = unsafe {
                ffi::MPI_Ibcast(
                    self.recv.as_mut_ptr().cast(),
                    count(n),
                    ffi::RSMPI_UINT8_T,
                    root as c_int,
                    self.world.as_raw(),
                    &mut req,
                )
            };
            if rc != 0 {
                return Err(ExchangeError::Failed(format!("MPI_Ibcast failed ({rc})")));
            }
            self.wait(req, deadline, Wait::for_bytes(n))?;
            buf[off..off + n].copy_from_slice(&self.recv[..n]);
            off += n;
        }
        Ok(())
    }

    fn announce(&mut self, news: &[u8; NEWS_BYTES]) -> Result<(), ExchangeError> {
        for h in (0..self.hosts).filter(|&h| h != self.host) {
            let buf = Box::new(*news);
            // SAFETY: a predefined handle, read only.
            let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
            // SAFETY: the boxed buffer holds NEWS_BYTES and is kept in
            // `news_sent` until the send completes (or leaked); the
            // destination is a rank of the communicator.
            let rc = unsafe {
                ffi::MPI_Isend(
                    buf.as_ptr().cast(),
                    NEWS_BYTES as c_int,
                    ffi::RSMPI_UINT8_T,
                    h as c_int,
                    NEWS_TAG,
                    self.world.as_raw(),
                    &mut req,
                )
            };
            if rc != 0 {
                return Err(ExchangeError::Failed(format!("MPI_Isend failed ({rc})")));
            }
            self.news_sent.push((req, buf));
        }
        Ok(())
    }

    fn poll_news(&mut self) -> Result<Option<[u8; NEWS_BYTES]>, ExchangeError> {
        // Finished sends give their buffers back; one that failed is
        // dropped from the list and its buffer leaked (MPI may still hold it).
        let mut i = 0;
        while i < self.news_sent.len() {
            let mut flag: c_int = 0;
            // SAFETY: an active request of this thread's MPI.
            let rc = unsafe {
                ffi::MPI_Test(
                    &mut self.news_sent[i].0,
                    &mut flag,
                    ffi::RSMPI_STATUS_IGNORE,
                )
            };
            if rc != 0 {
                std::mem::forget(self.news_sent.swap_remove(i));
            } else if flag != 0 {
                self.news_sent.swap_remove(i);
            } else {
                i += 1;
            }
        }
        let mut flag: c_int = 0;
        // SAFETY: the posted news receive, an active request of this
        // thread's MPI.
        let rc = unsafe { ffi::MPI_Test(&mut self.news_req, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
        if rc != 0 {
            // The buffer may still be written: leave it to MPI.
            std::mem::forget(std::mem::replace(
                &mut self.news_buf,
                Box::new([0; NEWS_BYTES]),
            ));
            return Err(ExchangeError::Failed(format!(
                "MPI_Test of the news receive failed ({rc})"
            )));
        }
        if flag == 0 {
            return Ok(None);
        }
        let news = *self.news_buf;
        self.post_news()?;
        Ok(Some(news))
    }

    fn abort(&mut self, why: &str) {
        log::error!("ending the MPI job: {why}");
        self.world.abort(1);
    }
}
