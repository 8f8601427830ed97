//! Classification metrics from predicted class probabilities: accuracy, macro-averaged
//! precision, recall and F1, ROC-AUC (binary: of the second class; more classes: the macro
//! mean of one-vs-rest AUCs) and the confusion matrix.

use serde::Serialize;

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Metrics {
    pub accuracy: f64,
    pub precision: f64,
    pub recall: f64,
    pub f1: f64,
    /// `None` where a class has no positive or no negative record (AUC is undefined).
    pub roc_auc: Option<f64>,
    /// `[true class][predicted class]`.
    pub confusion: Vec<Vec<usize>>,
}

/// The arg-max of each row of `probs[n, k]`.
pub fn predictions(probs: &[f32], k: usize) -> Vec<usize> {
    probs
        .chunks(k)
        .map(|p| {
            p.iter()
                .enumerate()
                .fold((0, f32::MIN), |b, (i, &v)| if v > b.1 { (i, v) } else { b })
                .0
        })
        .collect()
}

/// Area under the ROC curve of `scores` for `positive` labels (Mann-Whitney U, ties counted
/// half); `None` without both kinds.
pub fn roc_auc(scores: &[f32], positive: &[bool]) -> Option<f64> {
    let n_pos = positive.iter().filter(|&&p| p).count();
    let n_neg = positive.len() - n_pos;
    if n_pos == 0 || n_neg == 0 {
        return None;
    }
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]));
    // Sum of the positives' ranks, tied scores sharing their mean rank.
    let mut rank_sum = 0.0;
    let mut i = 0;
    while i < order.len() {
        let mut j = i;
        while j + 1 < order.len() && scores[order[j + 1]] == scores[order[i]] {
            j += 1;
        }
        let mean_rank = (i + j) as f64 / 2.0 + 1.0;
        rank_sum += mean_rank * order[i..=j].iter().filter(|&&o| positive[o]).count() as f64;
        i = j + 1;
    }
    let u = rank_sum - (n_pos * (n_pos + 1)) as f64 / 2.0;
    Some(u / (n_pos * n_neg) as f64)
}

/// Metrics of probabilities `probs[n, k]` against `labels`.
pub fn evaluate(probs: &[f32], labels: &[usize], k: usize) -> Metrics {
    let pred = predictions(probs, k);
    let mut confusion = vec![vec![0usize; k]; k];
    for (&t, &p) in labels.iter().zip(&pred) {
        confusion[t][p] += 1;
    }
    let n = labels.len().max(1) as f64;
    let correct: usize = (0..k).map(|c| confusion[c][c]).sum();
    let (mut p_sum, mut r_sum, mut f_sum) = (0.0, 0.0, 0.0);
    for (c, row) in confusion.iter().enumerate() {
        let tp = row[c] as f64;
        let predicted: usize = confusion.iter().map(|r| r[c]).sum();
        let actual: usize = row.iter().sum();
        let p = if predicted > 0 {
            tp / predicted as f64
        } else {
            0.0
        };
        let r = if actual > 0 { tp / actual as f64 } else { 0.0 };
        p_sum += p;
        r_sum += r;
        f_sum += if p + r > 0.0 {
            2.0 * p * r / (p + r)
        } else {
            0.0
        };
    }
    let class_auc = |c: usize| {
        let scores: Vec<f32> = probs.chunks(k).map(|p| p[c]).collect();
        let positive: Vec<bool> = labels.iter().map(|&l| l == c).collect();
        roc_auc(&scores, &positive)
    };
    let roc_auc = if k == 2 {
        class_auc(1)
    } else {
        (0..k)
            .map(class_auc)
            .collect::<Option<Vec<f64>>>()
            .map(|a| a.iter().sum::<f64>() / k as f64)
    };
    Metrics {
        accuracy: correct as f64 / n,
        precision: p_sum / k as f64,
        recall: r_sum / k as f64,
        f1: f_sum / k as f64,
        roc_auc,
        confusion,
    }
}

/// Mean and (sample) standard deviation.
pub fn mean_std(values: &[f64]) -> (f64, f64) {
    let n = values.len() as f64;
    if values.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let mean = values.iter().sum::<f64>() / n;
    let var = if values.len() > 1 {
        values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0)
    } else {
        0.0
    };
    (mean, var.sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_match_hand_computed_values() {
        // Truth 0,0,1,1,1; predicted 0,1,1,1,0.
        let probs = [0.9, 0.1, 0.4, 0.6, 0.2, 0.8, 0.3, 0.7, 0.6, 0.4];
        let m = evaluate(&probs, &[0, 0, 1, 1, 1], 2);
        assert_eq!(m.confusion, vec![vec![1, 1], vec![1, 2]]);
        assert!((m.accuracy - 0.6).abs() < 1e-12);
        // Class 0: P 1/2, R 1/2; class 1: P 2/3, R 2/3.
        assert!((m.precision - (0.5 + 2.0 / 3.0) / 2.0).abs() < 1e-12);
        assert!((m.f1 - (0.5 + 2.0 / 3.0) / 2.0).abs() < 1e-12);
        // Scores of class 1: negatives 0.1, 0.6; positives 0.8, 0.7, 0.4 -> 5 of 6 pairs
        // ordered (0.4 < 0.6 is the one that is not).
        assert!((m.roc_auc.unwrap() - 5.0 / 6.0).abs() < 1e-12);
        assert_eq!(roc_auc(&[0.5, 0.5], &[true, false]), Some(0.5));
        assert_eq!(roc_auc(&[0.5], &[true]), None);
    }
}
