//! What a test fault planned in `DMLC_TEST_FAULTS` ([`crate::fault`]) does
//! to the collective it fires on: kept apart from the engine's path, which
//! asks once per collective that moves data (one relaxed load when nothing
//! is planned).

use super::pieces::Piece;
use crate::fault::FaultState;

/// The faults armed for one collective.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct TestFault {
    /// The member whose outputs are left unwritten.
    pub(super) skip_write: Option<u32>,
    /// A part of the data movement panics.
    pub(super) panic: bool,
}

impl TestFault {
    /// The faults the plan fires on the collective `key` about to move
    /// `pieces` (none for a collective that moves no data); a skipped
    /// write or a dropped input is taken out of `pieces` here. Each fired
    /// fault is logged.
    pub(super) fn arm(faults: &FaultState, key: (u16, u64), pieces: &mut [Piece]) -> TestFault {
        if pieces.is_empty() {
            return TestFault::default();
        }
        let Some((nth, fired)) = faults.next() else {
            return TestFault::default();
        };
        let (queue, seq) = key;
        if let Some(rank) = fired.skip_write {
            log::warn!(
                "test fault: collective {nth} (queue {queue}, seq {seq}) leaves rank {rank}'s \
                 outputs unwritten"
            );
            forget_outputs(pieces, rank as usize);
        }
        if let Some(rank) = fired.drop_input {
            if leave_out_input(pieces, rank as usize) {
                log::warn!(
                    "test fault: collective {nth} (queue {queue}, seq {seq}) reduces without \
                     rank {rank}'s input"
                );
            }
        }
        if fired.panic {
            log::warn!("test fault: collective {nth} (queue {queue}, seq {seq}) panics in a part");
        }
        TestFault {
            skip_write: fired.skip_write,
            panic: fired.panic,
        }
    }
}

/// Drops member `member`'s outputs from every step (the skip-write test
/// fault): its buffers are read as usual but never written.
fn forget_outputs(pieces: &mut [Piece], member: usize) {
    for p in pieces {
        match p {
            Piece::Reduce { outputs, .. } => outputs.retain(|b| b.member != member),
            Piece::Copy { dsts, .. } => dsts.retain(|b| b.member != member),
        }
    }
}

/// Drops member `member`'s input from every reduction that has another
/// one (the drop-input test fault): every output gets the same result, one
/// that lacks its contribution. True if a reduction changed.
fn leave_out_input(pieces: &mut [Piece], member: usize) -> bool {
    let mut changed = false;
    for p in pieces {
        if let Piece::Reduce { inputs, .. } = p {
            if inputs.len() > 1 {
                let before = inputs.len();
                inputs.retain(|b| b.member != member);
                changed |= inputs.len() != before;
            }
        }
    }
    changed
}
