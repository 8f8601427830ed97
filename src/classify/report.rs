//! The report of a cross-validation: `report.md`, `metrics.json` (everything, the fold of
//! each record included) and `folds.png` (the metrics of each fold).

use super::Outcome;
use super::metrics::mean_std;
use crate::error::{KilnError, Result};
use crate::report::plot::{LinePlot, Plot, PlotError, Series};
use crate::report::table::Table;
use std::path::Path;

/// The metrics shown per fold, with how to read each from a fold's result.
type MetricOf = fn(&super::FoldResult) -> Option<f64>;
const METRICS: [(&str, MetricOf); 5] = [
    ("accuracy", |f| Some(f.metrics.accuracy)),
    ("precision", |f| Some(f.metrics.precision)),
    ("recall", |f| Some(f.metrics.recall)),
    ("F1", |f| Some(f.metrics.f1)),
    ("ROC-AUC", |f| f.metrics.roc_auc),
];

fn fmt(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.4}"))
}

/// Mean and standard deviation of a metric over the folds that have it.
fn summary(o: &Outcome, of: MetricOf) -> Option<(f64, f64)> {
    let v: Vec<f64> = o.fold_results.iter().filter_map(of).collect();
    (!v.is_empty()).then(|| mean_std(&v))
}

fn markdown(o: &Outcome, plot: Option<&str>) -> String {
    let mut s = String::from("# kiln classify\n\n");
    match o.encoder_lr {
        None => s += &format!("- encoder: {} (frozen)\n", o.encoder),
        Some(lr) => {
            s += &format!(
                "- encoder: {} ({} fine-tuning beside the head, AdamW lr {lr})\n",
                o.encoder,
                match o.finetune {
                    super::finetune::Finetune::Lora =>
                        "LoRA rank 8, alpha 16 on query, key, value and dense:",
                    _ => "full",
                }
            )
        }
    }
    s += &format!(
        "- data: {} records ({} with a text pair), classes {:?}, {} groups ({} records named one; the others are groups of their own)\n",
        o.records, o.pairs, o.classes, o.groups, o.grouped_records
    );
    if o.pairs > 0 {
        s += &format!(
            "- pairs: {}\n",
            match o.pair_encoding {
                super::PairEncoding::Cross =>
                    "encoded together (cross: one pass over text and pair)",
                super::PairEncoding::Bi => "embedded apart, features [u, v, |u - v|, u * v] (bi)",
            }
        );
    }
    s += &format!(
        "- head: {:?}, AdamW lr {}, weight decay {}, batch {}, at most {} epochs, early stopping on validation macro-F1 with patience {}, seed {}\n",
        o.head.kind,
        o.head.lr,
        o.head.weight_decay,
        o.head.batch_size,
        o.head.max_epochs,
        o.head.patience,
        o.head.seed
    );
    s += &format!(
        "- feature cache: {} (key {})\n",
        if o.encoder_lr.is_some() {
            "none (the encoder trains, so its features change at every step)"
        } else if o.cache.hit {
            "hit"
        } else if o.cache.path.is_some() {
            "miss (features encoded and stored)"
        } else {
            "off"
        },
        &o.cache.key[..16.min(o.cache.key.len())]
    );
    s += &format!(
        "- time: {} {:.2} s{}, {} {:.2} s\n",
        if o.encoder_lr.is_some() {
            "tokenising"
        } else {
            "encoding"
        },
        o.encode_seconds,
        if o.cache.hit {
            " (loading cached features and the encoder)"
        } else {
            ""
        },
        if o.encoder_lr.is_some() {
            "encoder and head training"
        } else {
            "head training"
        },
        o.head_seconds
    );
    s += &format!(
        "- truncated: {} of {} records were longer than {} tokens and were cut\n\n",
        o.truncated, o.records, o.max_length
    );

    s += "## Metrics\n\nMacro averages over the classes; ROC-AUC of the second class for two classes, the macro one-vs-rest mean otherwise.\n\n";
    let mut t = Table::new(&[
        "fold",
        "test records",
        "accuracy",
        "precision",
        "recall",
        "F1",
        "ROC-AUC",
        "epochs (best)",
    ]);
    for f in &o.fold_results {
        let mut row = vec![f.fold.to_string(), f.test_records.to_string()];
        row.extend(METRICS.iter().map(|(_, of)| fmt(of(f))));
        row.push(format!("{} ({})", f.epochs_run, f.best_epoch));
        t.row(row);
    }
    let mut row = vec!["mean ± std".to_string(), String::new()];
    row.extend(
        METRICS.iter().map(|(_, of)| {
            summary(o, *of).map_or("-".into(), |(m, sd)| format!("{m:.4} ± {sd:.4}"))
        }),
    );
    t.row(row);
    s += &t.markdown();
    s += "\n";
    if let Some(p) = plot {
        s += &format!("![metrics per fold]({p})\n\n");
    }

    s += "## Confusion matrix (summed over the folds)\n\n";
    let mut headers = vec!["true \\ predicted".to_string()];
    headers.extend(o.classes.iter().cloned());
    let mut t = Table::new(&headers);
    for (c, row) in o.confusion.iter().enumerate() {
        let mut cells = vec![o.classes[c].clone()];
        cells.extend(row.iter().map(usize::to_string));
        t.row(cells);
    }
    s += &t.markdown();
    s += "\n";

    s += "## Folds\n\nGroups on both sides of a fold's split, for kiln's grouped folds and for a plain stratified split of the same records (same seed) that ignores the groups.\n\n";
    let mut headers = vec![
        "fold".to_string(),
        "train".into(),
        "early stopping".into(),
        "test".into(),
    ];
    headers.extend(o.classes.iter().map(|c| format!("test {c}")));
    headers.push("leaking groups".into());
    headers.push("leaking groups, plain stratified".into());
    let mut t = Table::new(&headers);
    for (i, f) in o.fold_results.iter().enumerate() {
        let mut cells = vec![
            f.fold.to_string(),
            f.train_records.to_string(),
            f.early_stopping_records.to_string(),
            f.test_records.to_string(),
        ];
        cells.extend(f.test_class_counts.iter().map(usize::to_string));
        cells.push(o.leaking_groups[i].to_string());
        cells.push(o.stratified_leaking_groups[i].to_string());
        t.row(cells);
    }
    s += &t.markdown();
    s += "\n";
    if !o.warnings.is_empty() {
        s += "## Warnings\n\n";
        for w in &o.warnings {
            s += &format!("- {w}\n");
        }
        s += "\n";
    }
    s
}

/// Writes the report files into `dir`.
pub fn write(dir: &Path, o: &Outcome) -> Result<()> {
    let plot = Plot::Line(LinePlot {
        title: "metrics per fold".into(),
        x_label: "fold".into(),
        y_label: "score".into(),
        series: METRICS
            .iter()
            .map(|(name, of)| {
                Series::new(
                    *name,
                    o.fold_results
                        .iter()
                        .filter_map(|f| of(f).map(|v| (f.fold as f64, v)))
                        .collect(),
                )
            })
            .collect(),
        ..LinePlot::default()
    });
    let png = dir.join("folds.png");
    let drawn = match plot.render(&png) {
        Ok(()) => Some("folds.png"),
        Err(PlotError::Empty) => None,
        Err(e) => return Err(KilnError::output(&png, e)),
    };
    let mut json = serde_json::to_value(o).map_err(|e| KilnError::output(dir, e))?;
    let mut means = serde_json::Map::new();
    for (name, of) in METRICS {
        if let Some((m, sd)) = summary(o, of) {
            means.insert(
                name.to_string(),
                serde_json::json!({ "mean": m, "std": sd }),
            );
        }
    }
    json["summary"] = serde_json::Value::Object(means);
    let files = [
        ("report.md", markdown(o, drawn)),
        (
            "metrics.json",
            serde_json::to_string_pretty(&json).map_err(|e| KilnError::output(dir, e))?,
        ),
    ];
    for (name, body) in files {
        let path = dir.join(name);
        std::fs::write(&path, body).map_err(|e| KilnError::output(&path, e))?;
    }
    Ok(())
}
