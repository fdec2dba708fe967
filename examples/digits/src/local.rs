//! Ranks as threads of one process: a [`Collective`] that reduces through
//! shared memory in rank order, as the device does. For tests, and to try
//! the training without a backend.

use std::sync::{Arc, Barrier, Mutex, PoisonError};

use crate::train::{Collective, CommError};

/// One rank of a group of threads.
#[derive(Debug)]
pub struct Threads {
    rank: u32,
    n: u32,
    slots: Arc<Mutex<Vec<Vec<u64>>>>,
    barrier: Arc<Barrier>,
}

impl Threads {
    /// The `n` ranks of a new group, rank i at index i; give each to its own
    /// thread.
    pub fn group(n: u32) -> Vec<Threads> {
        let slots = Arc::new(Mutex::new(vec![Vec::new(); n as usize]));
        let barrier = Arc::new(Barrier::new(n as usize));
        (0..n)
            .map(|rank| Threads {
                rank,
                n,
                slots: Arc::clone(&slots),
                barrier: Arc::clone(&barrier),
            })
            .collect()
    }

    /// Publishes `mine`, waits for every rank, and returns all ranks' data
    /// in rank order.
    fn exchange(&self, mine: Vec<u64>) -> Vec<Vec<u64>> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)[self.rank as usize] = mine;
        self.barrier.wait();
        let all = self
            .slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        // Nobody may publish the next call's data before all have read.
        self.barrier.wait();
        all
    }
}

fn bits(buf: &[f32]) -> Vec<u64> {
    buf.iter().map(|v| u64::from(v.to_bits())).collect()
}

fn float(v: u64) -> f32 {
    // Only low 32 bits were stored, from f32::to_bits.
    f32::from_bits(v as u32)
}

impl Collective for Threads {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn world_size(&self) -> u32 {
        self.n
    }

    fn allreduce_sum_f32(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        let all = self.exchange(bits(buf));
        for (i, b) in buf.iter_mut().enumerate() {
            // Rank order, like the device: the same result on every rank.
            *b = float(all[0][i]);
            for other in &all[1..] {
                *b += float(other[i]);
            }
        }
        Ok(())
    }

    fn allreduce_max_u64(&mut self, buf: &mut [u64]) -> Result<(), CommError> {
        let all = self.exchange(buf.to_vec());
        for (i, b) in buf.iter_mut().enumerate() {
            *b = all.iter().map(|r| r[i]).fold(0, u64::max);
        }
        Ok(())
    }

    fn broadcast_f32(&mut self, buf: &mut [f32], root: u32) -> Result<(), CommError> {
        let all = self.exchange(bits(buf));
        for (b, &v) in buf.iter_mut().zip(&all[root as usize]) {
            *b = float(v);
        }
        Ok(())
    }
}
