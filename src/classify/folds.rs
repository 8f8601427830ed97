//! Grouped, stratified k-fold assignment, and the plain stratified split it is compared with.
//!
//! Grouped: every group goes whole to one fold, so no group is on both sides of any split
//! (pairs built from one document cannot leak). Stratified as far as the groups allow: groups
//! are placed largest first (ties in a seeded random order), each into the fold where its
//! records bring the fold's class counts closest to an even share of every class (the sum of
//! squared distances to `count_c / k`), the smaller fold on a tie. Like scikit-learn's
//! `StratifiedGroupKFold`, it is a greedy balance, not an optimum.

use crate::engine::rng::{Rng, stream};

/// Fold of each record, `0 .. k`.
pub type Assignment = Vec<usize>;

/// A seeded permutation of `0 .. n` (Fisher-Yates on kiln's counter-based RNG).
pub fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut rng = Rng::new(seed, stream::DATA);
    let mut v: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (rng.next_f32() as f64 * (i + 1) as f64) as usize;
        v.swap(i, j.min(i));
    }
    v
}

/// Grouped stratified folds of records with `labels` (classes `0 .. n_classes`) and
/// `groups` (any ids). Needs at least `k` distinct groups.
pub fn grouped_stratified(
    labels: &[usize],
    groups: &[usize],
    n_classes: usize,
    k: usize,
    seed: u64,
) -> Assignment {
    let n_groups = groups.iter().max().map_or(0, |g| g + 1);
    let mut counts = vec![vec![0usize; n_classes]; n_groups];
    for (&l, &g) in labels.iter().zip(groups) {
        counts[g][l] += 1;
    }
    let totals: Vec<f64> = (0..n_classes)
        .map(|c| counts.iter().map(|g| g[c]).sum::<usize>() as f64)
        .collect();
    let target: Vec<f64> = totals.iter().map(|t| t / k as f64).collect();
    let mut order: Vec<usize> = shuffled(n_groups, seed)
        .into_iter()
        .filter(|&g| counts[g].iter().sum::<usize>() > 0)
        .collect();
    order.sort_by_key(|&g| std::cmp::Reverse(counts[g].iter().sum::<usize>()));
    let mut fold_counts = vec![vec![0usize; n_classes]; k];
    let mut group_fold = vec![0usize; n_groups];
    for g in order {
        let cost = |f: usize| -> f64 {
            (0..n_classes)
                .map(|c| {
                    let (have, add) = (fold_counts[f][c] as f64, counts[g][c] as f64);
                    add * (2.0 * (have - target[c]) + add)
                })
                .sum()
        };
        let size = |f: usize| fold_counts[f].iter().sum::<usize>();
        let best = (0..k)
            .min_by(|&a, &b| cost(a).total_cmp(&cost(b)).then(size(a).cmp(&size(b))))
            .unwrap_or(0);
        group_fold[g] = best;
        for c in 0..n_classes {
            fold_counts[best][c] += counts[g][c];
        }
    }
    groups.iter().map(|&g| group_fold[g]).collect()
}

/// Plain stratified folds that ignore groups: each class's records, in a seeded order,
/// dealt round-robin to the folds (what a script without groups does).
pub fn stratified(labels: &[usize], n_classes: usize, k: usize, seed: u64) -> Assignment {
    let mut fold = vec![0; labels.len()];
    let mut next = 0;
    for c in 0..n_classes {
        for i in shuffled(labels.len(), seed ^ (c as u64 + 1)) {
            if labels[i] == c {
                fold[i] = next % k;
                next += 1;
            }
        }
    }
    fold
}

/// For each fold, the number of groups with records on both its validation side and its
/// training side: 0 everywhere for a leak-free split.
pub fn leaking_groups(folds: &[usize], groups: &[usize], k: usize) -> Vec<usize> {
    let n_groups = groups.iter().max().map_or(0, |g| g + 1);
    // Folds each group touches.
    let mut touched = vec![vec![false; k]; n_groups];
    for (&f, &g) in folds.iter().zip(groups) {
        touched[g][f] = true;
    }
    (0..k)
        .map(|f| {
            touched
                .iter()
                .filter(|t| t[f] && t.iter().enumerate().any(|(o, &on)| on && o != f))
                .count()
        })
        .collect()
}

/// Records of each class in each fold's validation side, `[fold][class]`.
pub fn class_counts(
    folds: &[usize],
    labels: &[usize],
    n_classes: usize,
    k: usize,
) -> Vec<Vec<usize>> {
    let mut out = vec![vec![0; n_classes]; k];
    for (&f, &l) in folds.iter().zip(labels) {
        out[f][l] += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Data built to tempt leakage: each group (a "document") holds one record of each class,
    /// so a stratified split that ignores groups puts nearly every group on both sides.
    fn paired(n_groups: usize) -> (Vec<usize>, Vec<usize>) {
        let mut labels = Vec::new();
        let mut groups = Vec::new();
        for g in 0..n_groups {
            for l in [0, 1, 1, 0] {
                labels.push(l);
                groups.push(g);
            }
        }
        (labels, groups)
    }

    #[test]
    fn grouped_folds_never_leak_where_stratified_ones_do() {
        let (labels, groups) = paired(40);
        let k = 5;
        let grouped = grouped_stratified(&labels, &groups, 2, k, 3);
        assert!(leaking_groups(&grouped, &groups, k).iter().all(|&n| n == 0));
        let plain = stratified(&labels, 2, k, 3);
        let leaks: usize = leaking_groups(&plain, &groups, k).iter().sum();
        assert!(
            leaks > 40,
            "a stratified split should leak most groups, leaked {leaks}"
        );
        // Balanced: every fold holds 8 whole groups, 16 records of each class.
        for counts in class_counts(&grouped, &labels, 2, k) {
            assert_eq!(counts, vec![16, 16]);
        }
    }

    #[test]
    fn uneven_groups_are_balanced_as_far_as_they_allow() {
        // Groups of sizes 1..=20, each of one class (alternating), 4 folds.
        let (mut labels, mut groups) = (Vec::new(), Vec::new());
        for g in 0..20 {
            for _ in 0..=g {
                labels.push(g % 2);
                groups.push(g);
            }
        }
        let k = 4;
        let f = grouped_stratified(&labels, &groups, 2, k, 1);
        assert!(leaking_groups(&f, &groups, k).iter().all(|&n| n == 0));
        let counts = class_counts(&f, &labels, 2, k);
        let total: Vec<usize> = (0..2).map(|c| counts.iter().map(|f| f[c]).sum()).collect();
        for fold in &counts {
            for c in 0..2 {
                let share = fold[c] as f64 / total[c] as f64;
                assert!((share - 0.25).abs() < 0.1, "fold {fold:?} of {total:?}");
            }
        }
        // The same seed gives the same folds.
        assert_eq!(f, grouped_stratified(&labels, &groups, 2, k, 1));
    }
}
