//! Background data loading: one thread that loads, tokenises and then keeps a few training
//! batches ready, so that the training step never waits on the data pipeline.
//!
//! The batches are the ones [`train_batch`] builds for `(step, micro)` in order; the thread
//! only computes them ahead of time. Which windows a step sees therefore does not depend on
//! timing, queue depth or where a run was resumed.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, sync_channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::sft::{self, SftFormat, SftTokenizer};
use super::{
    Batch, Corpus, DataError, TokenSplits, check_train_len, encode_chunked, is_tokenizer_path,
    split_tokens, tokenizer_by_name, tokenizer_from_path, train_batch,
};
use std::path::Path;

/// Everything the loader needs to reproduce a run's data stream.
#[derive(Debug, Clone, PartialEq)]
pub struct DataSpec {
    /// Corpus file; `None` for the bundled corpus.
    pub corpus: Option<PathBuf>,
    /// Tokenizer name, see [`tokenizer_by_name`](super::tokenizer_by_name).
    pub tokenizer: String,
    /// Fraction of tokens held out at the end for validation, in [0, 1).
    pub val_fraction: f64,
    /// A validation file in the corpus's shape: the whole corpus then trains.
    pub val_corpus: Option<PathBuf>,
    pub seed: u64,
    pub micro_batch: usize,
    pub seq: usize,
    /// Micro-batches per optimizer step.
    pub grad_accum: usize,
    /// Threads that tokenise the corpus.
    pub threads: usize,
    /// `data.format`: "text", or a fine-tuning format of JSON lines (see [`super::sft`]).
    pub format: String,
    /// The data order's micro index of this process's first micro-batch of a step: 0, or
    /// `rank * grad_accum` for a rank of a data-parallel run, which reads micro-batches
    /// `micro_offset..micro_offset + grad_accum` of every global batch.
    pub micro_offset: u64,
}

impl DataSpec {
    fn validate(&self) -> Result<(), DataError> {
        if !(0.0..1.0).contains(&self.val_fraction) {
            return Err(DataError::InvalidSpec(format!(
                "data.val_fraction must be at least 0 and below 1, got {}",
                self.val_fraction
            )));
        }
        for (name, v) in [
            ("train.micro_batch", self.micro_batch),
            ("train.seq_len", self.seq),
            ("train.grad_accum", self.grad_accum),
        ] {
            if v == 0 {
                return Err(DataError::InvalidSpec(format!("{name} must be at least 1")));
            }
        }
        Ok(())
    }
}

/// A `(step, micro, batch)` item of the queue.
type Item = (u64, u64, Batch);

enum SplitState {
    Pending,
    Ready(TokenSplits),
    /// The loader failed; the message of the first error, repeated to later callers.
    Failed(String),
}

/// Owns the loader thread and the receiving ends of its queues.
pub struct Prefetcher {
    splits_rx: Option<Receiver<Result<TokenSplits, DataError>>>,
    batches: Option<Receiver<Item>>,
    handle: Option<JoinHandle<()>>,
    cancel: Arc<AtomicBool>,
    state: SplitState,
    /// Set when the thread could not start or ended without a result.
    thread_failure: Option<String>,
    waited: Duration,
}

impl Prefetcher {
    /// Starts the loader. It produces micro-batches `(step, micro)` for `step = start_step..`
    /// and `micro in 0..grad_accum`, keeping at most `depth` (at least 1) ready.
    ///
    /// Errors (a bad corpus, an unknown tokenizer, a split too short) are reported by
    /// [`splits`](Self::splits) and [`next`](Self::next).
    pub fn spawn(spec: DataSpec, start_step: u64, depth: usize) -> Prefetcher {
        let (splits_tx, splits_rx) = sync_channel(1);
        let (batch_tx, batch_rx) = sync_channel(depth.max(1));
        let cancel = Arc::new(AtomicBool::new(false));
        let thread_cancel = Arc::clone(&cancel);
        let spawned = std::thread::Builder::new()
            .name("kiln-data".to_string())
            .spawn(move || produce(spec, start_step, splits_tx, batch_tx, &thread_cancel));
        let (handle, thread_failure) = match spawned {
            Ok(h) => (Some(h), None),
            Err(e) => (None, Some(format!("cannot start the loader thread: {e}"))),
        };
        Prefetcher {
            splits_rx: Some(splits_rx),
            batches: Some(batch_rx),
            handle,
            cancel,
            state: SplitState::Pending,
            thread_failure,
            waited: Duration::ZERO,
        }
    }

    /// The train and validation tokens, blocking until the corpus is tokenised. Any loading
    /// error surfaces here, first as itself and afterwards as [`DataError::Loader`].
    pub fn splits(&mut self) -> Result<TokenSplits, DataError> {
        match &self.state {
            SplitState::Ready(s) => return Ok(s.clone()),
            SplitState::Failed(msg) => return Err(DataError::Loader(msg.clone())),
            SplitState::Pending => {}
        }
        let received = match &self.splits_rx {
            Some(rx) => rx.recv().ok(),
            None => None,
        };
        self.splits_rx = None;
        match received {
            Some(Ok(s)) => {
                self.state = SplitState::Ready(s.clone());
                Ok(s)
            }
            Some(Err(e)) => {
                self.state = SplitState::Failed(e.to_string());
                Err(e)
            }
            // The thread ended without reporting: it panicked or never started.
            None => {
                let msg = self.thread_failure();
                self.state = SplitState::Failed(msg.clone());
                Err(DataError::Loader(msg))
            }
        }
    }

    /// The next micro-batch as `(step, micro, batch)`, blocking until it is ready.
    // Not an `Iterator`: the stream never ends, and a failure is an error to report, not an end.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Result<(u64, u64, Batch), DataError> {
        if let Some(rx) = &self.batches {
            match rx.try_recv() {
                Ok(item) => return Ok(item),
                Err(TryRecvError::Empty) => {
                    let t0 = Instant::now();
                    let got = rx.recv();
                    self.waited += t0.elapsed();
                    if let Ok(item) = got {
                        return Ok(item);
                    }
                }
                Err(TryRecvError::Disconnected) => {}
            }
        }
        // The producer only closes the queue when loading failed or the thread died; report
        // the loading error if there was one.
        self.splits()?;
        Err(DataError::Loader(self.thread_failure()))
    }

    /// Total time [`next`](Self::next) has spent waiting for the loader.
    pub fn wait_stats(&self) -> Duration {
        self.waited
    }

    /// Why the thread is gone, joining it the first time to recover a panic message.
    fn thread_failure(&mut self) -> String {
        if let Some(handle) = self.handle.take() {
            let msg = match handle.join() {
                Ok(()) => "the loader thread stopped unexpectedly".to_string(),
                Err(payload) => {
                    let what = payload
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| payload.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "unknown cause".to_string());
                    format!("the loader thread panicked: {what}")
                }
            };
            self.thread_failure = Some(msg);
        }
        self.thread_failure
            .clone()
            .unwrap_or_else(|| "the loader thread stopped unexpectedly".to_string())
    }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        // Cancelling stops tokenisation between chunks; dropping the receivers makes a blocked
        // `send` fail. Either way the thread returns promptly and the join cannot hang.
        self.cancel.store(true, Ordering::Relaxed);
        self.batches = None;
        self.splits_rx = None;
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}

/// The training rows an epoch of `spec`'s data draws: its packed fine-tuning rows, or the
/// windows of `spec.seq` tokens its training split holds. Loads and tokenises the data (as
/// the loader does again for the run).
pub fn epoch_rows(spec: &DataSpec) -> Result<usize, DataError> {
    let splits = load_splits(spec)?;
    Ok(match &splits.sft {
        Some(d) => d.train.len(),
        None => splits.train.len() / spec.seq,
    })
}

/// `spec`'s training and validation splits, loaded in this thread as the loader would.
pub fn load_splits(spec: &DataSpec) -> Result<TokenSplits, DataError> {
    prepare(spec, &AtomicBool::new(false))?
        .ok_or_else(|| DataError::Loader("the data was not loaded".into()))
}

/// Loads, tokenises and splits; `Ok(None)` when cancelled part way.
fn prepare(spec: &DataSpec, cancel: &AtomicBool) -> Result<Option<TokenSplits>, DataError> {
    spec.validate()?;
    if let Some(format) = SftFormat::from_setting(&spec.format) {
        return prepare_sft(spec, format).map(Some);
    }
    let tokenizer = tokenizer_by_name(&spec.tokenizer)?;
    let corpus = Corpus::load(spec.corpus.as_deref())?;
    let Some(tokens) = encode_chunked(tokenizer.as_ref(), &corpus.text, cancel, spec.threads)
    else {
        return Ok(None);
    };
    drop(corpus);
    let splits = match &spec.val_corpus {
        None => split_tokens(tokens, spec.val_fraction),
        Some(path) => {
            let text = Corpus::load(Some(path.as_path()))?.text;
            let Some(val) = encode_chunked(tokenizer.as_ref(), &text, cancel, spec.threads) else {
                return Ok(None);
            };
            // Validation windows are train.seq_len + 1 tokens.
            if val.len() <= spec.seq {
                return Err(DataError::File {
                    path: path.clone(),
                    reason: format!(
                        "holds {} tokens, and a validation window of train.seq_len={} needs {}; give a longer validation file (data.val_corpus) or lower train.seq_len",
                        val.len(),
                        spec.seq,
                        spec.seq + 1
                    ),
                });
            }
            TokenSplits {
                train: Arc::new(tokens),
                val: Arc::new(val),
                sft: None,
            }
        }
    };
    check_train_len(&splits.train, spec.seq)?;
    Ok(Some(splits))
}

/// Loads a fine-tuning file: packed rows, and the trained targets as the token streams.
fn prepare_sft(spec: &DataSpec, format: SftFormat) -> Result<TokenSplits, DataError> {
    let path = spec.corpus.as_deref().ok_or_else(|| {
        DataError::InvalidSpec(format!(
            "data.format={} reads JSON lines from data.corpus (kiln finetune --data FILE); the bundled corpus is plain text",
            spec.format
        ))
    })?;
    let pretrained;
    let plain;
    let tok = if is_tokenizer_path(&spec.tokenizer) {
        pretrained = tokenizer_from_path(Path::new(&spec.tokenizer))?;
        SftTokenizer::Pretrained(&pretrained)
    } else {
        plain = tokenizer_by_name(&spec.tokenizer)?;
        SftTokenizer::Plain(plain.as_ref())
    };
    let holdout = match &spec.val_corpus {
        Some(file) => sft::Holdout::File(file),
        None => sft::Holdout::Fraction(spec.val_fraction),
    };
    let data = sft::load(path, format, &tok, spec.seq, holdout)?;
    let trained = |r: &sft::SftRows| -> Vec<u32> {
        r.targets
            .iter()
            .copied()
            .filter(|&t| t != crate::engine::ops::IGNORE_TARGET)
            .collect()
    };
    Ok(TokenSplits {
        train: Arc::new(trained(&data.train)),
        val: Arc::new(trained(&data.val)),
        sft: Some(Arc::new(data)),
    })
}

fn produce(
    spec: DataSpec,
    start_step: u64,
    splits_tx: SyncSender<Result<TokenSplits, DataError>>,
    batch_tx: SyncSender<Item>,
    cancel: &AtomicBool,
) {
    let splits = match prepare(&spec, cancel) {
        Ok(Some(s)) => s,
        Ok(None) => return,
        Err(e) => {
            // A failed send means the Prefetcher is gone; nobody is left to tell.
            let _ = splits_tx.send(Err(e));
            return;
        }
    };
    if splits_tx.send(Ok(splits.clone())).is_err() {
        return;
    }
    let train = splits.train;
    let sft = splits.sft;
    for step in start_step..=u64::MAX {
        for micro in spec.micro_offset..spec.micro_offset + spec.grad_accum as u64 {
            if cancel.load(Ordering::Relaxed) {
                return;
            }
            let b = match &sft {
                Some(d) => sft::train_rows(&d.train, spec.seed, step, micro, 0..spec.micro_batch),
                None => train_batch(&train, spec.seed, step, micro, spec.micro_batch, spec.seq),
            };
            if batch_tx.send((step, micro, b)).is_err() {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{Gpt2Tokenizer, Tokenizer};

    fn spec(corpus: Option<PathBuf>, tokenizer: &str) -> DataSpec {
        DataSpec {
            corpus,
            tokenizer: tokenizer.to_string(),
            val_fraction: 0.05,
            val_corpus: None,
            seed: 1234,
            micro_batch: 4,
            seq: 32,
            grad_accum: 3,
            threads: 2,
            format: "text".into(),
            micro_offset: 0,
        }
    }

    fn temp_corpus(tag: &str, text: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!(
            "kiln-prefetch-{tag}-{}-{:?}.txt",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn yields_train_batches_in_order_from_start_step() {
        let text = "The quick brown fox jumps over the lazy dog.\n".repeat(200);
        let path = temp_corpus("order", &text);
        let s = spec(Some(path.clone()), "byte");
        let mut p = Prefetcher::spawn(s.clone(), 5, 2);
        let splits = p.splits().unwrap();
        std::fs::remove_file(&path).unwrap();
        let expect = split_tokens(text.bytes().map(u32::from).collect(), s.val_fraction);
        assert_eq!(splits, expect);
        for want_step in 5..9u64 {
            for want_micro in 0..3u64 {
                let (step, micro, b) = p.next().unwrap();
                assert_eq!((step, micro), (want_step, want_micro));
                let want = train_batch(&splits.train, s.seed, step, micro, 4, 32);
                assert_eq!(b, want);
            }
        }
        // Splits stay available after batches started flowing.
        assert_eq!(p.splits().unwrap(), expect);
        let _ = p.wait_stats();
    }

    /// With a validation file the whole corpus trains and the file validates; a file too
    /// short for one validation window is refused by name.
    #[test]
    fn a_validation_file_replaces_the_held_out_tail() {
        let text = "The quick brown fox jumps over the lazy dog.\n".repeat(50);
        let val_text = "Pack my box with five dozen liquor jugs.\n".repeat(3);
        let (path, val) = (temp_corpus("whole", &text), temp_corpus("val", &val_text));
        let mut s = spec(Some(path.clone()), "byte");
        s.val_corpus = Some(val.clone());
        let splits = Prefetcher::spawn(s.clone(), 0, 2).splits().unwrap();
        assert_eq!(
            *splits.train,
            text.bytes().map(u32::from).collect::<Vec<_>>()
        );
        assert_eq!(
            *splits.val,
            val_text.bytes().map(u32::from).collect::<Vec<_>>()
        );
        s.seq = val_text.len();
        let e = Prefetcher::spawn(s, 0, 2).splits().unwrap_err().to_string();
        assert!(
            e.contains(&*val.to_string_lossy()) && e.contains("train.seq_len"),
            "{e}"
        );
        std::fs::remove_file(&path).unwrap();
        std::fs::remove_file(&val).unwrap();
    }

    #[test]
    fn bundled_corpus_with_gpt2() {
        let mut s = spec(None, "gpt2");
        s.seq = 64;
        let mut p = Prefetcher::spawn(s.clone(), 0, 4);
        let splits = p.splits().unwrap();
        // The chunked encoding is the whole-text encoding: 1,566,042 tokens, 3.2 bytes each.
        let whole = Gpt2Tokenizer::new()
            .unwrap()
            .encode(&Corpus::load(None).unwrap().text);
        assert_eq!(whole.len(), 1_566_042);
        assert_eq!(splits.val.len(), 78_302);
        assert_eq!([&splits.train[..], &splits.val[..]].concat(), whole);
        let (step, micro, b) = p.next().unwrap();
        assert_eq!((step, micro), (0, 0));
        assert_eq!(b, train_batch(&splits.train, s.seed, 0, 0, 4, 64));
    }

    #[test]
    fn drop_does_not_hang() {
        let t0 = Instant::now();
        // Dropped while the queue is full and the producer is blocked on send.
        let mut p = Prefetcher::spawn(spec(None, "byte"), 0, 1);
        // Asked before the corpus is even decompressed: this call has to wait.
        p.next().unwrap();
        assert!(p.wait_stats() > Duration::ZERO);
        std::thread::sleep(Duration::from_millis(20));
        drop(p);
        // Dropped at once, while still loading or tokenising.
        drop(Prefetcher::spawn(spec(None, "gpt2"), 0, 1));
        assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    }

    #[test]
    fn loading_errors_surface_in_splits_and_next() {
        let missing =
            std::env::temp_dir().join(format!("kiln-prefetch-missing-{}.txt", std::process::id()));
        let mut p = Prefetcher::spawn(spec(Some(missing), "byte"), 0, 2);
        assert!(matches!(p.splits(), Err(DataError::CorpusMissing { .. })));
        // Later calls repeat the cause.
        let err = p.next().unwrap_err();
        assert!(err.to_string().contains("does not exist"), "{err}");

        let mut p = Prefetcher::spawn(spec(None, "sentencepiece"), 0, 2);
        assert!(matches!(p.next(), Err(DataError::UnknownTokenizer { .. })));

        let path = temp_corpus("short", "just a few words\n");
        let mut p = Prefetcher::spawn(spec(Some(path.clone()), "byte"), 0, 2);
        let err = p.splits().unwrap_err();
        std::fs::remove_file(&path).unwrap();
        assert!(
            matches!(err, DataError::TooShort { split: "train", .. }),
            "{err:?}"
        );

        let mut s = spec(None, "byte");
        s.grad_accum = 0;
        let mut p = Prefetcher::spawn(s, 0, 2);
        assert!(matches!(p.splits(), Err(DataError::InvalidSpec(_))));
    }
}
