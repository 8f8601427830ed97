//! Cross-validated text classification on a frozen encoder: `kiln classify`.
//!
//! The records are split into k grouped, stratified folds ([`folds`]), every text (and pair)
//! is embedded once by the frozen encoder and the features are kept in an on-disk cache keyed
//! by the encoder (weights, pooling, precision, maximum length) and the texts, so a rerun or
//! more epochs cost only the head. For each fold a head ([`head`]) trains on the other folds,
//! with a grouped validation part of them for early stopping, and is scored on the fold;
//! [`report`] writes the metrics per fold and as mean and deviation.

pub mod data;
pub mod dataset;
pub mod finetune;
pub mod folds;
pub mod head;
pub mod metrics;
pub mod report;

use crate::data::DataError;
use crate::embed::{Encoded, EncoderOptions, TextEncoder};
use crate::error::{KilnError, Result};
use data::Dataset;
use finetune::{Finetune, FinetuneSetup};
use head::{HeadKind, HeadOptions};
use metrics::Metrics;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Everything `kiln classify` takes.
#[derive(Debug, Clone)]
pub struct ClassifyOptions {
    pub init_from: PathBuf,
    pub data: PathBuf,
    pub folds: usize,
    pub out: PathBuf,
    pub encoder: EncoderOptions,
    /// Texts per encoder batch.
    pub batch_size: usize,
    pub head: HeadOptions,
    /// Where features are cached; `None` turns the cache off.
    pub cache_dir: Option<PathBuf>,
    pub pair_encoding: PairEncoding,
    /// Whether the encoder stays frozen or trains with the head ([`finetune`]).
    pub finetune: Finetune,
    /// The encoder's AdamW learning rate when it trains (`None`: the mode's default).
    pub encoder_lr: Option<f32>,
}

/// How a record with a `text_pair` becomes one feature vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum PairEncoding {
    /// Both texts through the encoder together: `[CLS] a [SEP] b [SEP]` with token types for
    /// BERT, joined by a line break for a decoder; one pooled vector. The encoder's attention
    /// is the only place the two texts meet, so a frozen sentence encoder with a linear head
    /// often cannot tell whether they match.
    Cross,
    /// Each text embedded alone, features `[u, v, |u - v|, u * v]` (sentence-transformers'
    /// classification features): a linear head on `u * v` is a learned similarity.
    Bi,
}

/// What one fold gave.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FoldResult {
    pub fold: usize,
    pub train_records: usize,
    pub early_stopping_records: usize,
    pub test_records: usize,
    /// Records of each class on the validation side.
    pub test_class_counts: Vec<usize>,
    pub epochs_run: usize,
    pub best_epoch: usize,
    pub metrics: Metrics,
}

/// The feature cache's verdict.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CacheUse {
    pub key: String,
    pub hit: bool,
    pub path: Option<PathBuf>,
}

/// A finished cross-validation, as the report shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Outcome {
    pub encoder: String,
    pub finetune: Finetune,
    /// The encoder's learning rate, when it trained.
    pub encoder_lr: Option<f32>,
    pub pair_encoding: PairEncoding,
    pub records: usize,
    pub pairs: usize,
    pub classes: Vec<String>,
    pub groups: usize,
    pub grouped_records: usize,
    pub folds: usize,
    pub head: HeadOptions,
    pub fold_results: Vec<FoldResult>,
    /// Groups on both sides of each fold: kiln's folds, and a plain stratified split of the
    /// same records with the same seed for comparison.
    pub leaking_groups: Vec<usize>,
    pub stratified_leaking_groups: Vec<usize>,
    /// Confusion matrix summed over the folds.
    pub confusion: Vec<Vec<usize>>,
    pub cache: CacheUse,
    pub truncated: usize,
    pub max_length: usize,
    pub encode_seconds: f64,
    pub head_seconds: f64,
    pub warnings: Vec<String>,
    /// Fold of each record, in the file's order.
    pub assignment: Vec<usize>,
}

fn data_error(path: &Path, reason: String) -> KilnError {
    KilnError::Data(DataError::File {
        path: path.to_path_buf(),
        reason,
    })
}

/// Reads the cached features `[n, d]` and truncation flags at `path`, if they are there and
/// whole (a damaged file is a miss, and is rewritten).
fn load_cached(path: &Path, n: usize, d: usize) -> Option<(Vec<f32>, Vec<bool>)> {
    let bytes = std::fs::read(path).ok()?;
    let st = safetensors::SafeTensors::deserialize(&bytes).ok()?;
    let floats = |name: &str, len: usize| -> Option<Vec<f32>> {
        let t = st.tensor(name).ok()?;
        (t.dtype() == safetensors::Dtype::F32 && t.data().len() == len * 4).then(|| {
            t.data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        })
    };
    let features = floats("features", n * d)?;
    let truncated = floats("truncated", n)?.iter().map(|&v| v != 0.0).collect();
    Some((features, truncated))
}

fn save_cached(path: &Path, features: &[f32], truncated: &[bool], d: usize) -> Result<()> {
    use safetensors::tensor::TensorView;
    let n = truncated.len();
    let f: Vec<u8> = features.iter().flat_map(|v| v.to_le_bytes()).collect();
    let t: Vec<u8> = truncated
        .iter()
        .flat_map(|&v| f32::from(u8::from(v)).to_le_bytes())
        .collect();
    let views = [
        (
            "features",
            TensorView::new(safetensors::Dtype::F32, vec![n, d], &f)
                .map_err(|e| KilnError::output(path, e))?,
        ),
        (
            "truncated",
            TensorView::new(safetensors::Dtype::F32, vec![n], &t)
                .map_err(|e| KilnError::output(path, e))?,
        ),
    ];
    let bytes = safetensors::serialize(views, None).map_err(|e| KilnError::output(path, e))?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| KilnError::output(dir, e))?;
    }
    let tmp = path.with_extension("partial");
    std::fs::write(&tmp, bytes)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            KilnError::output(path, e)
        })
}

/// The features of every record (from the cache, or encoded and cached), with the
/// truncation flags and the cache's verdict.
fn features(
    o: &ClassifyOptions,
    encoder: &TextEncoder,
    ds: &Dataset,
) -> Result<(Vec<f32>, Vec<bool>, CacheUse)> {
    use sha2::Digest;
    let (n, d) = (ds.records.len(), feature_dim(o, encoder, ds));
    let mut h = sha2::Sha256::new();
    h.update(encoder.fingerprint()?);
    h.update(ds.texts_sha256());
    h.update(format!(
        "max_length={};pairs={:?}",
        encoder.max_length(),
        o.pair_encoding
    ));
    let key = format!("{:x}", h.finalize());
    let path = o
        .cache_dir
        .as_ref()
        .map(|d| d.join(format!("{key}.safetensors")));
    if let Some(p) = &path
        && let Some((f, t)) = load_cached(p, n, d)
    {
        return Ok((
            f,
            t,
            CacheUse {
                key,
                hit: true,
                path: path.clone(),
            },
        ));
    }
    let (features, truncated) = encode_records(o, encoder, ds)?;
    if let Some(p) = &path {
        save_cached(p, &features, &truncated, d)?;
    }
    Ok((
        features,
        truncated,
        CacheUse {
            key,
            hit: false,
            path,
        },
    ))
}

/// Width of a record's features: the encoder's, or four times it for [`PairEncoding::Bi`]
/// on records with pairs.
fn feature_dim(o: &ClassifyOptions, encoder: &TextEncoder, ds: &Dataset) -> usize {
    let pairs = ds.records.iter().any(|r| r.text_pair.is_some());
    if pairs && o.pair_encoding == PairEncoding::Bi {
        4 * encoder.dim()
    } else {
        encoder.dim()
    }
}

/// Runs the encoder over every distinct input once (a speech paired with two titles is one
/// text in bi mode) and assembles each record's features, with its truncation flag.
fn encode_records(
    o: &ClassifyOptions,
    encoder: &TextEncoder,
    ds: &Dataset,
) -> Result<(Vec<f32>, Vec<bool>)> {
    use std::collections::HashMap;
    let bi =
        o.pair_encoding == PairEncoding::Bi && ds.records.iter().any(|r| r.text_pair.is_some());
    if bi && let Some(i) = ds.records.iter().position(|r| r.text_pair.is_none()) {
        return Err(data_error(
            &o.data,
            format!(
                "record {} has no \"text_pair\" while others have one; --pair-encoding bi needs a pair on every record (or use cross)",
                i + 1
            ),
        ));
    }
    // Distinct encoder inputs, and for each record the inputs it is made of.
    type Input<'a> = (&'a str, Option<&'a str>);
    fn intern<'a>(
        key: Input<'a>,
        inputs: &mut Vec<Input<'a>>,
        index: &mut HashMap<Input<'a>, usize>,
    ) -> usize {
        *index.entry(key).or_insert_with(|| {
            inputs.push(key);
            inputs.len() - 1
        })
    }
    let mut inputs: Vec<Input> = Vec::new();
    let mut index: HashMap<Input, usize> = HashMap::new();
    let parts: Vec<Vec<usize>> = ds
        .records
        .iter()
        .map(|r| match (&r.text_pair, bi) {
            (Some(p), true) => vec![
                intern((&r.text, None), &mut inputs, &mut index),
                intern((p, None), &mut inputs, &mut index),
            ],
            (p, _) => vec![intern((&r.text, p.as_deref()), &mut inputs, &mut index)],
        })
        .collect();
    let encoded: Vec<Encoded> = encoder.encode_all(&inputs)?;
    let rows = encoder.embed(&encoded, o.batch_size)?;
    let mut features = Vec::with_capacity(ds.records.len() * feature_dim(o, encoder, ds));
    let mut truncated = Vec::with_capacity(ds.records.len());
    for p in &parts {
        truncated.push(p.iter().any(|&i| encoded[i].truncated));
        match p.as_slice() {
            [one] => features.extend_from_slice(&rows[*one]),
            [a, b] => {
                let (u, v) = (&rows[*a], &rows[*b]);
                features.extend_from_slice(u);
                features.extend_from_slice(v);
                features.extend(u.iter().zip(v).map(|(x, y)| (x - y).abs()));
                features.extend(u.iter().zip(v).map(|(x, y)| x * y));
            }
            _ => unreachable!("a record is one or two encoder inputs"),
        }
    }
    Ok((features, truncated))
}

/// Checks the settings, reads the data and makes the folds; then encodes, trains a head per
/// fold and writes the report into `o.out`.
pub fn run(o: &ClassifyOptions) -> Result<Outcome> {
    if o.folds < 2 {
        return Err(KilnError::Setting(format!(
            "--folds {} cannot cross-validate; use 2 or more (5 is usual)",
            o.folds
        )));
    }
    if o.head.max_epochs == 0 || o.head.batch_size == 0 || o.batch_size == 0 {
        return Err(KilnError::Setting(
            "--epochs, --head-batch-size and --batch-size must be 1 or more".into(),
        ));
    }
    if let HeadKind::Mlp { hidden: 0 } = o.head.kind {
        return Err(KilnError::Setting(
            "--hidden 0 leaves the MLP no units; use 1 or more (256 is usual)".into(),
        ));
    }
    let ds = Dataset::read(&o.data)?;
    let (k, n_classes) = (o.folds, ds.classes.len());
    if ds.groups.len() < k {
        return Err(data_error(
            &o.data,
            format!(
                "has {} groups, fewer than the {k} folds (each fold needs a group of its own); lower --folds to at most {} or add groups",
                ds.groups.len(),
                ds.groups.len()
            ),
        ));
    }
    let labels = ds.labels();
    let groups = ds.group_ids();
    let assignment = folds::grouped_stratified(&labels, &groups, n_classes, k, o.head.seed);
    let mut warnings = Vec::new();
    // A class in fewer groups than folds cannot reach every fold: say which folds lack it.
    for (c, name) in ds.classes.iter().enumerate() {
        let mut with: Vec<usize> = (0..ds.records.len())
            .filter(|&i| labels[i] == c)
            .map(|i| groups[i])
            .collect();
        with.sort_unstable();
        with.dedup();
        if with.len() < k {
            warnings.push(format!(
                "class {name:?} is in {} group(s), fewer than the {k} folds: too small to stratify, so some folds cannot hold it on both sides",
                with.len()
            ));
        }
    }
    let counts = folds::class_counts(&assignment, &labels, n_classes, k);
    let totals: Vec<usize> = (0..n_classes)
        .map(|c| counts.iter().map(|f| f[c]).sum())
        .collect();
    for (f, fc) in counts.iter().enumerate() {
        for (c, name) in ds.classes.iter().enumerate() {
            if fc[c] == 0 {
                warnings.push(format!(
                    "fold {}: the validation side has no {name:?} records, so its training and validation label sets differ",
                    f + 1
                ));
            } else if fc[c] == totals[c] {
                warnings.push(format!(
                    "fold {}: every {name:?} record is on the validation side; its training side has none",
                    f + 1
                ));
            }
        }
    }
    let leaking_groups = folds::leaking_groups(&assignment, &groups, k);
    let plain = folds::stratified(&labels, n_classes, k, o.head.seed);
    let stratified_leaking_groups = folds::leaking_groups(&plain, &groups, k);

    if o.finetune != Finetune::Frozen
        && o.pair_encoding == PairEncoding::Bi
        && ds.records.iter().any(|r| r.text_pair.is_some())
    {
        return Err(KilnError::Setting(
            "--finetune trains the encoder on pairs encoded together; use --pair-encoding cross (or leave --finetune out for bi)".into(),
        ));
    }
    std::fs::create_dir_all(&o.out).map_err(|e| KilnError::output(&o.out, e))?;
    let (
        description,
        max_length,
        cache,
        truncated,
        encode_seconds,
        head_seconds,
        fold_results,
        confusion,
    ) = if o.finetune == Finetune::Frozen {
        let start = Instant::now();
        let encoder = TextEncoder::open(&o.init_from, &o.encoder)?;
        eprintln!("encoder: {}", encoder.description);
        let (x, truncated, cache) = features(o, &encoder, &ds)?;
        let encode_seconds = start.elapsed().as_secs_f64();
        eprintln!(
            "features: {} ({} records, {encode_seconds:.1} s)",
            if cache.hit {
                "cache hit"
            } else {
                "cache miss, encoded"
            },
            ds.records.len()
        );
        let d = feature_dim(o, &encoder, &ds);
        let start = Instant::now();
        let mut fold_results = Vec::with_capacity(k);
        let mut confusion = vec![vec![0; n_classes]; n_classes];
        for (f, fold_counts) in counts.iter().enumerate() {
            let sides = FoldSides::new(&assignment, f, &labels, &groups, n_classes, o.head.seed);
            let trained = head::train(
                &x,
                d,
                &labels,
                n_classes,
                &sides.train,
                &sides.early_stopping,
                &o.head,
            );
            let probs = trained.predict_proba(&x, d, &sides.test);
            fold_results.push(sides.score(
                (f, k),
                &probs,
                &labels,
                fold_counts,
                (trained.epochs_run, trained.best_epoch),
                &mut confusion,
            ));
        }
        let head_seconds = start.elapsed().as_secs_f64();
        (
            encoder.description.clone(),
            encoder.max_length(),
            cache,
            truncated.iter().filter(|&&t| t).count(),
            encode_seconds,
            head_seconds,
            fold_results,
            confusion,
        )
    } else {
        finetune_folds(o, &ds, &labels, &groups, &assignment, &counts)?
    };
    let outcome = Outcome {
        encoder: description,
        finetune: o.finetune,
        encoder_lr: (o.finetune != Finetune::Frozen)
            .then(|| o.encoder_lr.unwrap_or(o.finetune.default_lr())),
        pair_encoding: o.pair_encoding,
        records: ds.records.len(),
        pairs: ds.records.iter().filter(|r| r.text_pair.is_some()).count(),
        classes: ds.classes.clone(),
        groups: ds.groups.len(),
        grouped_records: ds.grouped_records,
        folds: k,
        head: o.head,
        fold_results,
        leaking_groups,
        stratified_leaking_groups,
        confusion,
        cache,
        truncated,
        max_length,
        encode_seconds,
        head_seconds,
        warnings,
        assignment,
    };
    for w in &outcome.warnings {
        eprintln!("warning: {w}");
    }
    report::write(&o.out, &outcome)?;
    Ok(outcome)
}

/// What the cross-validation of one mode gives the report: the encoder's description, its
/// maximum length, the cache's verdict, the truncated records, the encoding and training
/// seconds, the folds' results and the summed confusion matrix.
type FoldsRun = (
    String,
    usize,
    CacheUse,
    usize,
    f64,
    f64,
    Vec<FoldResult>,
    Vec<Vec<usize>>,
);

/// The folds with the encoder trained beside the head ([`finetune`]): the records are
/// tokenised once (cross pairs), and each fold trains a fresh encoder; no feature cache.
fn finetune_folds(
    o: &ClassifyOptions,
    ds: &Dataset,
    labels: &[usize],
    groups: &[usize],
    assignment: &[usize],
    counts: &[Vec<usize>],
) -> Result<FoldsRun> {
    let (k, n_classes) = (o.folds, ds.classes.len());
    let start = Instant::now();
    // Opened once to check the model and tokenise; each fold opens its own fresh copy.
    let setup = FinetuneSetup {
        init_from: &o.init_from,
        encoder: &o.encoder,
        mode: o.finetune,
        encoder_lr: o.encoder_lr.unwrap_or(o.finetune.default_lr()),
        batch_size: o.batch_size,
        head: &o.head,
    };
    let probe = finetune::open_trainable(&setup)?;
    let description = format!(
        "{}, fine-tuned ({})",
        probe.description,
        match o.finetune {
            Finetune::Lora => "LoRA",
            _ => "full",
        }
    );
    eprintln!("encoder: {description}");
    let texts: Vec<(&str, Option<&str>)> = ds
        .records
        .iter()
        .map(|r| (r.text.as_str(), r.text_pair.as_deref()))
        .collect();
    let inputs = probe.encode_all(&texts)?;
    let max_length = probe.max_length();
    drop(probe);
    let encode_seconds = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let mut fold_results = Vec::with_capacity(k);
    let mut confusion = vec![vec![0; n_classes]; n_classes];
    for (f, fold_counts) in counts.iter().enumerate() {
        let sides = FoldSides::new(assignment, f, labels, groups, n_classes, o.head.seed);
        eprintln!(
            "fold {}/{k}: fine-tuning on {} records",
            f + 1,
            sides.train.len()
        );
        let trained = finetune::train_fold(
            &setup,
            &inputs,
            labels,
            n_classes,
            &sides.train,
            &sides.early_stopping,
        )?;
        let probs = finetune::predict(&trained, &inputs, &sides.test, o.batch_size)?;
        fold_results.push(sides.score(
            (f, k),
            &probs,
            labels,
            fold_counts,
            (trained.epochs_run, trained.best_epoch),
            &mut confusion,
        ));
    }
    let cache = CacheUse {
        key: String::new(),
        hit: false,
        path: None,
    };
    let truncated = inputs.iter().filter(|e| e.truncated).count();
    Ok((
        description,
        max_length,
        cache,
        truncated,
        encode_seconds,
        start.elapsed().as_secs_f64(),
        fold_results,
        confusion,
    ))
}

/// The records of one fold: its test fold, and the rest split into the records a head trains
/// on and those early stopping watches (a grouped part of the training side, never the test
/// fold).
struct FoldSides {
    test: Vec<usize>,
    train: Vec<usize>,
    early_stopping: Vec<usize>,
}

impl FoldSides {
    fn new(
        assignment: &[usize],
        fold: usize,
        labels: &[usize],
        groups: &[usize],
        n_classes: usize,
        seed: u64,
    ) -> FoldSides {
        let (test, rest): (Vec<usize>, Vec<usize>) =
            (0..labels.len()).partition(|&i| assignment[i] == fold);
        let (train, early_stopping) = early_stopping_split(&rest, labels, groups, n_classes, seed);
        FoldSides {
            test,
            train,
            early_stopping,
        }
    }

    /// Scores the probabilities predicted for the test fold (fold `f` of `k`): adds its
    /// confusion matrix into `confusion`, prints its line, and returns its result with the
    /// fold's class counts and its head's (epochs run, best epoch).
    fn score(
        &self,
        (f, k): (usize, usize),
        probs: &[f32],
        labels: &[usize],
        class_counts: &[usize],
        (epochs_run, best_epoch): (usize, usize),
        confusion: &mut [Vec<usize>],
    ) -> FoldResult {
        let test_labels: Vec<usize> = self.test.iter().map(|&i| labels[i]).collect();
        let m = metrics::evaluate(probs, &test_labels, confusion.len());
        for (row, add) in confusion.iter_mut().zip(&m.confusion) {
            row.iter_mut().zip(add).for_each(|(a, b)| *a += b);
        }
        eprintln!(
            "fold {}/{k}: {} test records, accuracy {:.3}, macro-F1 {:.3}, ROC-AUC {}",
            f + 1,
            self.test.len(),
            m.accuracy,
            m.f1,
            m.roc_auc.map_or("-".into(), |a| format!("{a:.3}"))
        );
        FoldResult {
            fold: f + 1,
            train_records: self.train.len(),
            early_stopping_records: self.early_stopping.len(),
            test_records: self.test.len(),
            test_class_counts: class_counts.to_vec(),
            epochs_run,
            best_epoch,
            metrics: m,
        }
    }
}

/// Splits the training side `rest` into the rows a head trains on and a grouped, stratified
/// fifth that early stopping watches. With fewer than two groups there is nothing to hold
/// out and every row trains (the head then keeps its last epoch).
fn early_stopping_split(
    rest: &[usize],
    labels: &[usize],
    groups: &[usize],
    n_classes: usize,
    seed: u64,
) -> (Vec<usize>, Vec<usize>) {
    let mut ids: Vec<usize> = rest.iter().map(|&i| groups[i]).collect();
    let mut distinct = ids.clone();
    distinct.sort_unstable();
    distinct.dedup();
    if distinct.len() < 2 {
        return (rest.to_vec(), Vec::new());
    }
    for g in &mut ids {
        *g = distinct.binary_search(g).unwrap_or(0);
    }
    let parts = distinct.len().min(5);
    let sub: Vec<usize> = rest.iter().map(|&i| labels[i]).collect();
    let fold = folds::grouped_stratified(&sub, &ids, n_classes, parts, seed ^ 0x5eed);
    let (mut train, mut val) = (Vec::new(), Vec::new());
    for (j, &i) in rest.iter().enumerate() {
        if fold[j] == 0 {
            val.push(i);
        } else {
            train.push(i);
        }
    }
    (train, val)
}
