//! The arithmetic of data parallelism, kept pure so it can be tested on its own: which rows of
//! every global batch a rank reads, how gradients are grouped into buckets for the all-reduce,
//! which rank owns which parameter's optimizer state under ZeRO, and what each GPU then holds.

use std::ops::Range;

/// ZeRO stage: what is sharded across ranks besides nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum ZeroStage {
    /// Plain data parallelism: every rank holds everything; gradients are all-reduced.
    Zero0,
    /// Optimizer moments sharded: gradients all-reduced, each rank updates the parameters it
    /// owns, and the updated values are broadcast from their owners.
    Zero1,
    /// Moments and reduced gradients sharded: each gradient is reduced to its owner only, and
    /// the other ranks release their copy after the step.
    Zero2,
}

impl ZeroStage {
    pub fn from_setting(n: usize) -> Option<ZeroStage> {
        match n {
            0 => Some(ZeroStage::Zero0),
            1 => Some(ZeroStage::Zero1),
            2 => Some(ZeroStage::Zero2),
            _ => None,
        }
    }

    pub fn number(self) -> usize {
        match self {
            ZeroStage::Zero0 => 0,
            ZeroStage::Zero1 => 1,
            ZeroStage::Zero2 => 2,
        }
    }
}

/// The micro-batches of every global batch that rank `rank` of `world` reads: with
/// `grad_accum` per rank, the global batch has `grad_accum * world` micro-batches (counted by
/// the data order's micro index) and the rank reads a consecutive run of them. Their union is
/// exactly what one process reading `grad_accum * world` micro-batches reads.
pub fn rank_micro_batches(rank: usize, world: usize, grad_accum: usize) -> Range<u64> {
    assert!(rank < world);
    let start = (rank * grad_accum) as u64;
    start..start + grad_accum as u64
}

/// Buckets of parameters (indices into the trainable parameters, in that order) for the
/// gradient reduction, in the order they are sent: backward produces the gradients of the
/// last parameters first, so buckets are cut from the end, each closing once it holds at
/// least `cap_bytes` (a parameter larger than the cap is a bucket of its own).
pub fn buckets(bytes: &[usize], cap_bytes: usize) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut end = bytes.len();
    let mut size = 0usize;
    for i in (0..bytes.len()).rev() {
        size += bytes[i];
        if size >= cap_bytes.max(1) {
            out.push(i..end);
            end = i;
            size = 0;
        }
    }
    if end > 0 {
        out.push(0..end);
    }
    out
}

/// The buckets every parameter of which has its final gradient once the parameters from
/// `first_final` on have theirs (backward went below `first_final`).
pub fn ready_buckets(buckets: &[Range<usize>], first_final: usize) -> usize {
    buckets
        .iter()
        .take_while(|b| b.start >= first_final)
        .count()
}

/// The rank that owns each parameter's optimizer state: consecutive runs of parameters with
/// about `1/world` of the elements each (a rank's run ends at the parameter that crosses its
/// share), so every rank holds within one parameter of an even share.
pub fn owners(elements: &[usize], world: usize) -> Vec<usize> {
    let total: usize = elements.iter().sum();
    let mut out = Vec::with_capacity(elements.len());
    let mut before = 0usize;
    for &n in elements {
        // The rank whose share the middle of this parameter falls in.
        let mid = before as u128 * 2 + n as u128;
        let rank = if total == 0 {
            0
        } else {
            ((mid * world as u128) / (2 * total as u128)) as usize
        };
        out.push(rank.min(world - 1));
        before += n;
    }
    out
}

/// What one GPU holds for the model's state (not activations), in bytes.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct StateBytes {
    /// f32 masters, plus compute copies under mixed precision.
    pub weights: usize,
    /// Gradients kept through the step (all of them during backward).
    pub grads_during_backward: usize,
    /// Gradients kept after the reduction (stage 2: the owned ones only).
    pub grads_after_reduce: usize,
    /// AdamW's two f32 moments of the parameters this rank updates.
    pub moments: usize,
}

impl StateBytes {
    /// The larger of the backward's state and the optimizer step's.
    pub fn peak(&self) -> usize {
        self.weights + self.moments + self.grads_during_backward.max(self.grads_after_reduce)
    }
}

/// The state bytes on rank `rank` for parameters of `elements`, gradients of `grad_bytes`
/// per element and `compute_bytes` per element of compute copy (0 without one).
pub fn state_bytes(
    elements: &[usize],
    owners: &[usize],
    rank: usize,
    stage: ZeroStage,
    grad_bytes: usize,
    compute_bytes: usize,
) -> StateBytes {
    let all: usize = elements.iter().sum();
    let owned: usize = elements
        .iter()
        .zip(owners)
        .filter(|(_, o)| **o == rank)
        .map(|(n, _)| n)
        .sum();
    let moments_of = match stage {
        ZeroStage::Zero0 => all,
        ZeroStage::Zero1 | ZeroStage::Zero2 => owned,
    };
    let grads_after = match stage {
        ZeroStage::Zero2 => owned,
        _ => all,
    };
    StateBytes {
        weights: all * (4 + compute_bytes),
        grads_during_backward: all * grad_bytes,
        grads_after_reduce: grads_after * grad_bytes,
        moments: moments_of * 8,
    }
}

/// Which parameters rank `rank` restores moments for when a checkpoint (which holds every
/// parameter's moments, whatever world wrote it) is resumed on `world` ranks.
pub fn restored_by(elements: &[usize], world: usize, rank: usize, stage: ZeroStage) -> Vec<usize> {
    let o = owners(elements, world);
    (0..elements.len())
        .filter(|&i| stage == ZeroStage::Zero0 || o[i] == rank)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_read_disjoint_runs_that_cover_the_global_batch() {
        for world in 1..6 {
            for accum in 1..4 {
                let mut seen: Vec<u64> = (0..world)
                    .flat_map(|r| rank_micro_batches(r, world, accum))
                    .collect();
                seen.sort();
                assert_eq!(seen, (0..(world * accum) as u64).collect::<Vec<_>>());
            }
        }
        assert_eq!(rank_micro_batches(2, 4, 3), 6..9);
    }

    #[test]
    fn buckets_are_cut_from_the_end_and_cover_every_parameter_once() {
        let bytes = [100, 10, 10, 10, 50, 5, 5, 200];
        let b = buckets(&bytes, 60);
        assert_eq!(b, vec![7..8, 4..7, 0..4]);
        let mut covered: Vec<usize> = b.iter().flat_map(|r| r.clone()).collect();
        covered.sort();
        assert_eq!(covered, (0..bytes.len()).collect::<Vec<_>>());
        // A huge cap makes one bucket; a tiny one a bucket per parameter.
        assert_eq!(buckets(&bytes, usize::MAX), vec![0..8]);
        assert_eq!(buckets(&bytes, 1).len(), bytes.len());
        assert!(buckets(&[], 10).is_empty());
    }

    #[test]
    fn a_bucket_is_ready_once_backward_passed_all_of_it() {
        let b = vec![7..8, 4..7, 0..4];
        assert_eq!(ready_buckets(&b, 8), 0);
        assert_eq!(ready_buckets(&b, 7), 1);
        assert_eq!(ready_buckets(&b, 5), 1);
        assert_eq!(ready_buckets(&b, 4), 2);
        assert_eq!(ready_buckets(&b, 0), 3);
    }

    #[test]
    fn owners_are_consecutive_and_balanced_within_one_parameter() {
        let elements = [
            38_597_376, 786_432, 768, 2_359_296, 2304, 589_824, 768, 4_718_592, 3072,
        ];
        for world in 1..=8 {
            let o = owners(&elements, world);
            assert!(o.windows(2).all(|w| w[0] <= w[1]), "{o:?}");
            assert!(o.iter().all(|&r| r < world));
        }
        // Many equal parameters split evenly.
        let even = vec![10usize; 12];
        for world in [1, 2, 3, 4, 6] {
            let o = owners(&even, world);
            for r in 0..world {
                assert_eq!(
                    o.iter().filter(|&&x| x == r).count(),
                    12 / world,
                    "world {world}: {o:?}"
                );
            }
        }
        let largest = 10;
        let o = owners(&even[..7], 3);
        for r in 0..3 {
            let held: usize = o.iter().filter(|&&x| x == r).count() * 10;
            assert!(
                (held as i64 - 70 / 3).unsigned_abs() as usize <= largest,
                "{o:?}"
            );
        }
    }

    #[test]
    fn state_per_gpu_shrinks_with_the_stage() {
        let elements = vec![1000usize; 8];
        let o = owners(&elements, 4);
        let s0 = state_bytes(&elements, &o, 1, ZeroStage::Zero0, 4, 2);
        let s1 = state_bytes(&elements, &o, 1, ZeroStage::Zero1, 4, 2);
        let s2 = state_bytes(&elements, &o, 1, ZeroStage::Zero2, 4, 2);
        assert_eq!(s0.moments, 8000 * 8);
        assert_eq!(s1.moments, 2000 * 8);
        assert_eq!(s2.moments, 2000 * 8);
        assert_eq!(s1.grads_after_reduce, 8000 * 4);
        assert_eq!(s2.grads_after_reduce, 2000 * 4);
        assert_eq!(s0.weights, 8000 * 6);
        assert!(s0.peak() > s1.peak());
        assert_eq!(
            s1.peak(),
            s2.peak(),
            "kiln keeps every gradient through backward"
        );
    }

    #[test]
    fn resharding_restores_every_moment_exactly_once_on_any_world() {
        let elements = [5usize, 900, 30, 30, 400, 7, 1200, 64];
        for world in 1..=5 {
            let mut all: Vec<usize> = (0..world)
                .flat_map(|r| restored_by(&elements, world, r, ZeroStage::Zero1))
                .collect();
            all.sort();
            assert_eq!(
                all,
                (0..elements.len()).collect::<Vec<_>>(),
                "world {world}"
            );
            // Plain data parallelism restores everything everywhere.
            assert_eq!(
                restored_by(&elements, world, 0, ZeroStage::Zero0).len(),
                elements.len()
            );
        }
    }
}
