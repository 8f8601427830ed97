//! Checkpoints: weights and optimizer state as safetensors (readable by PyTorch), trainer
//! state and the model's shape as JSON.
//!
//! A checkpoint is a directory `checkpoints/step_NNNNNNN/`. It is written under a temporary
//! name, every file is synced, and only then is it renamed into place and the `latest` pointer
//! replaced (itself by rename). A failed write, a full disk included, therefore never touches
//! the last good checkpoint, and removes its temporary files. The state is copied to host
//! memory at a step boundary ([`snapshot`]) and written by [`Writer`] on a background thread,
//! so training does not wait for the disk. Loading checks the model shape before reading any tensor, so a
//! checkpoint of another model fails with a message that says which dimension differs.
//!
//! Every checkpoint carries `manifest.json`: the size and CRC-32 of each of its files, written
//! last. Every reader (resume, eval, generate, `kiln verify`) checks a file against it before
//! parsing it, so a truncated file, a flipped bit in a header, a weight or an optimizer moment,
//! or a missing file is refused by name instead of loading silently; the error lists the
//! checkpoints of the run that do verify and how to select one (`--checkpoint step_N`).
//!
//! The files do not depend on where the optimizer keeps its state: with
//! `train.offload_optimizer` the masters and moments are read from and restored into host
//! memory under the same names, so a run may switch offload on or off when it resumes.

use super::oom::PassSize;
use super::trainer::{TrainState, Trainer};
use crate::config::ModelConfig;
use crate::engine::Tensor;
use crate::error::{KilnError, Result};
use crate::models::Model;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

const FORMAT_VERSION: u32 = 1;
const MODEL_FILE: &str = "model.safetensors";
const OPTIMIZER_FILE: &str = "optimizer.safetensors";
const STATE_FILE: &str = "trainer.json";
pub const MANIFEST_FILE: &str = "manifest.json";
const LATEST: &str = "latest";
/// The files a manifest lists, in the order they are written.
const DATA_FILES: [&str; 3] = [MODEL_FILE, OPTIMIZER_FILE, STATE_FILE];
/// Older checkpoints beyond this many are deleted after a new one is in place.
const KEEP: usize = 2;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CheckpointMeta {
    pub format_version: u32,
    pub model: ModelConfig,
    pub vocab: usize,
    pub state: TrainState,
    pub adam_t: u64,
    /// The out-of-memory split the run had settled on; absent when memory never ran out
    /// (and in checkpoints written before it was kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub learned_passes: Option<LearnedPasses>,
}

/// Rows per forward/backward pass learned from out-of-memory errors, and the memory they
/// were learned under: the `train.memory_limit` cap, or the device's total (none on a CPU
/// without a cap).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LearnedPasses {
    pub rows: usize,
    pub capacity_bytes: Option<usize>,
}

pub fn checkpoints_dir(run_dir: &Path) -> PathBuf {
    run_dir.join("checkpoints")
}

/// The checkpoint `latest` points to in `run_dir`, if any.
pub fn latest(run_dir: &Path) -> Result<Option<PathBuf>> {
    let pointer = checkpoints_dir(run_dir).join(LATEST);
    if !pointer.is_file() {
        return Ok(None);
    }
    let name =
        fs::read_to_string(&pointer).map_err(|e| KilnError::checkpoint(&pointer, e.to_string()))?;
    Ok(Some(checkpoints_dir(run_dir).join(name.trim())))
}

/// The size and CRC-32 of every file of a checkpoint, written after them.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    pub format_version: u32,
    /// Always "crc32" (IEEE, as zlib): fast enough to check gigabytes at load.
    pub hash: String,
    pub files: Vec<ManifestEntry>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ManifestEntry {
    pub name: String,
    pub bytes: u64,
    /// Lower-case hex, 8 digits.
    pub crc32: String,
}

fn crc_hex(bytes: &[u8]) -> String {
    format!("{:08x}", crc32fast::hash(bytes))
}

/// What a damaged checkpoint's error says to do next (the caller adds the run's checkpoints
/// that verify when it knows the run directory).
const DAMAGED_HINT: &str = "the file is damaged";

pub fn read_manifest(ckpt: &Path) -> Result<Manifest> {
    let path = ckpt.join(MANIFEST_FILE);
    let text = fs::read_to_string(&path).map_err(|e| {
        KilnError::checkpoint(
            ckpt,
            format!(
                "cannot read {MANIFEST_FILE} ({e}): the checkpoint was not completely written, or was written by a kiln without verified checkpoints"
            ),
        )
    })?;
    let manifest: Manifest = serde_json::from_str(&text)
        .map_err(|e| KilnError::checkpoint(&path, format!("is damaged ({e}); {DAMAGED_HINT}")))?;
    if manifest.hash != "crc32" {
        return Err(KilnError::checkpoint(
            &path,
            format!("uses hash '{}', this kiln checks crc32 only", manifest.hash),
        ));
    }
    for name in DATA_FILES {
        if !manifest.files.iter().any(|f| f.name == name) {
            return Err(KilnError::checkpoint(
                &path,
                format!("does not list {name}; {DAMAGED_HINT}"),
            ));
        }
    }
    Ok(manifest)
}

/// Reads `name` from `ckpt` and checks its size and CRC-32 against the manifest.
fn read_verified(ckpt: &Path, manifest: &Manifest, name: &str) -> Result<Vec<u8>> {
    let path = ckpt.join(name);
    let entry = manifest
        .files
        .iter()
        .find(|f| f.name == name)
        .ok_or_else(|| {
            KilnError::checkpoint(
                ckpt.join(MANIFEST_FILE),
                format!("does not list {name}; {DAMAGED_HINT}"),
            )
        })?;
    let bytes = fs::read(&path).map_err(|e| {
        KilnError::checkpoint(
            &path,
            format!("cannot read ({e}); the checkpoint is incomplete"),
        )
    })?;
    if bytes.len() as u64 != entry.bytes {
        return Err(KilnError::checkpoint(
            &path,
            format!(
                "is {} bytes, its manifest says {}: it is truncated or damaged",
                bytes.len(),
                entry.bytes
            ),
        ));
    }
    let crc = crc_hex(&bytes);
    if crc != entry.crc32 {
        return Err(KilnError::checkpoint(
            &path,
            format!(
                "does not match its manifest (crc32 {crc}, recorded {}): {DAMAGED_HINT}",
                entry.crc32
            ),
        ));
    }
    Ok(bytes)
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = fs::File::create(path).map_err(|e| KilnError::output(path, e))?;
    f.write_all(bytes)
        .and_then(|_| f.sync_all())
        .map_err(|e| KilnError::output(path, e))
}

fn to_bytes(t: &Tensor) -> Result<Vec<u8>> {
    Ok(t.to_vec()?.iter().flat_map(|v| v.to_le_bytes()).collect())
}

fn serialize(tensors: Vec<(String, &Tensor)>) -> Result<Vec<u8>> {
    let bytes = tensors
        .into_iter()
        .map(|(n, t)| Ok((n, t.shape().to_vec(), to_bytes(t)?)))
        .collect::<Result<Vec<(String, Vec<usize>, Vec<u8>)>>>()?;
    let views = bytes
        .iter()
        .map(|(n, s, b)| Ok((n.clone(), TensorView::new(Dtype::F32, s.clone(), b)?)))
        .collect::<std::result::Result<Vec<_>, safetensors::SafeTensorError>>()
        .map_err(|e| KilnError::Setting(format!("internal: cannot build safetensors view: {e}")))?;
    safetensors::serialize(views, None)
        .map_err(|e| KilnError::Setting(format!("internal: safetensors: {e}")))
}

/// A checkpoint copied to host memory at a step boundary, ready to be written by any thread.
pub struct Snapshot {
    pub step: u64,
    name: String,
    files: Vec<(&'static str, Vec<u8>)>,
}

impl Snapshot {
    /// Bytes the checkpoint takes on disk (its manifest aside).
    pub fn bytes(&self) -> usize {
        self.files.iter().map(|(_, b)| b.len()).sum()
    }
}

/// A checkpoint in place: where, how large, and how long writing it took.
#[derive(Debug, Clone)]
pub struct Written {
    pub dir: PathBuf,
    pub step: u64,
    pub bytes: usize,
    pub write_s: f64,
}

/// Copies the trainer's weights, optimizer moments and state into host memory.
pub fn snapshot(trainer: &Trainer) -> Result<Snapshot> {
    // Only what trains is saved: every weight, or the adapters over a frozen base (which
    // `lora.base` names and the run's init_from.json pins by hash).
    let params = trainer.model.trainable_params();
    let model = serialize(params.iter().map(|p| (p.name.clone(), &p.value)).collect())?;
    let mut opt: Vec<(String, &Tensor)> = Vec::new();
    for ((p, m), v) in params.iter().zip(&trainer.opt.m).zip(&trainer.opt.v) {
        opt.push((format!("exp_avg.{}", p.name), m));
        opt.push((format!("exp_avg_sq.{}", p.name), v));
    }
    let optimizer = serialize(opt)?;
    let meta = CheckpointMeta {
        format_version: FORMAT_VERSION,
        model: trainer.cfg.model.clone(),
        vocab: trainer.vocab,
        state: trainer.state,
        adam_t: trainer.opt.t,
        learned_passes: trainer.passes.learned().map(|rows| LearnedPasses {
            rows,
            capacity_bytes: trainer.pool.capacity(),
        }),
    };
    let json = serde_json::to_vec_pretty(&meta)
        .map_err(|e| KilnError::Setting(format!("internal: trainer state to JSON: {e}")))?;
    Ok(Snapshot {
        step: trainer.state.step,
        name: step_name(trainer.state.step),
        files: vec![
            (MODEL_FILE, model),
            (OPTIMIZER_FILE, optimizer),
            (STATE_FILE, json),
        ],
    })
}

pub fn step_name(step: u64) -> String {
    format!("step_{step:07}")
}

/// Writes a snapshot under `run_dir`: files and manifest into a temporary directory, each
/// synced, then renamed into place, then the `latest` pointer replaced by rename. On failure
/// the temporary files are removed and the previous checkpoint and pointer are untouched.
pub fn write(snap: &Snapshot, run_dir: &Path) -> Result<Written> {
    let started = std::time::Instant::now();
    let dir = checkpoints_dir(run_dir);
    let tmp = dir.join(format!(".{}.tmp", snap.name));
    let pointer_tmp = dir.join(".latest.tmp");
    let result = write_in(snap, &dir, &tmp, &pointer_tmp);
    if result.is_err() {
        let _ = fs::remove_dir_all(&tmp);
        let _ = fs::remove_file(&pointer_tmp);
    }
    let final_dir = result?;
    prune(&dir, KEEP);
    Ok(Written {
        dir: final_dir,
        step: snap.step,
        bytes: snap.bytes(),
        write_s: started.elapsed().as_secs_f64(),
    })
}

fn write_in(snap: &Snapshot, dir: &Path, tmp: &Path, pointer_tmp: &Path) -> Result<PathBuf> {
    let _ = fs::remove_dir_all(tmp);
    fs::create_dir_all(tmp).map_err(|e| KilnError::output(tmp, e))?;
    let mut manifest = Manifest {
        format_version: FORMAT_VERSION,
        hash: "crc32".into(),
        files: Vec::new(),
    };
    for (name, bytes) in &snap.files {
        write_synced(&tmp.join(name), bytes)?;
        manifest.files.push(ManifestEntry {
            name: name.to_string(),
            bytes: bytes.len() as u64,
            crc32: crc_hex(bytes),
        });
    }
    let json = serde_json::to_vec_pretty(&manifest).map_err(|e| KilnError::output(tmp, e))?;
    write_synced(&tmp.join(MANIFEST_FILE), &json)?;
    let final_dir = dir.join(&snap.name);
    let _ = fs::remove_dir_all(&final_dir);
    fs::rename(tmp, &final_dir).map_err(|e| KilnError::output(&final_dir, e))?;
    write_synced(pointer_tmp, snap.name.as_bytes())?;
    fs::rename(pointer_tmp, dir.join(LATEST))
        .map_err(|e| KilnError::output(dir.join(LATEST), e))?;
    // The renames are durable only once the directory itself is synced.
    if let Ok(d) = fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(final_dir)
}

/// Writes checkpoints on a background thread so training goes on while they reach the disk.
///
/// At most one write is in flight: [`Writer::submit`] first waits for the previous one, so
/// memory holds at most two host copies of the state (the one being written and the new one)
/// and checkpoints land in step order.
pub struct Writer {
    run_dir: PathBuf,
    in_flight: Option<std::thread::JoinHandle<Result<Written>>>,
}

impl Writer {
    pub fn new(run_dir: &Path) -> Writer {
        Writer {
            run_dir: run_dir.to_path_buf(),
            in_flight: None,
        }
    }

    /// Waits for the write in flight, if any, and returns what it wrote.
    pub fn wait(&mut self) -> Result<Option<Written>> {
        let Some(handle) = self.in_flight.take() else {
            return Ok(None);
        };
        match handle.join() {
            Ok(result) => result.map(Some),
            Err(_) => Err(KilnError::output(
                checkpoints_dir(&self.run_dir),
                "the checkpoint writer thread panicked",
            )),
        }
    }

    /// Starts writing `snap` once the previous write is done; returns the previous write.
    pub fn submit(&mut self, snap: Snapshot) -> Result<Option<Written>> {
        let previous = self.wait()?;
        let run_dir = self.run_dir.clone();
        let handle = std::thread::Builder::new()
            .name("kiln-checkpoint".into())
            .spawn(move || write(&snap, &run_dir))
            .map_err(|e| KilnError::output(checkpoints_dir(&self.run_dir), e))?;
        self.in_flight = Some(handle);
        Ok(previous)
    }
}

impl Drop for Writer {
    /// A run that ends by an error still finishes (or cleans up) the write it started.
    fn drop(&mut self) {
        let _ = self.wait();
    }
}

/// Writes the trainer's checkpoint under `run_dir` in this thread and returns its directory.
pub fn save(trainer: &Trainer, run_dir: &Path) -> Result<PathBuf> {
    Ok(write(&snapshot(trainer)?, run_dir)?.dir)
}

/// Deletes all but the newest `keep` checkpoints; failures only leave extra files behind.
fn prune(dir: &Path, keep: usize) {
    let mut names = step_names(dir);
    names.sort();
    for old in names.iter().rev().skip(keep) {
        let _ = fs::remove_dir_all(dir.join(old));
    }
}

/// Names of the `step_N` directories under a `checkpoints/` directory, unordered.
fn step_names(dir: &Path) -> Vec<String> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("step_"))
        .collect()
}

/// Every checkpoint of a run, newest first.
pub fn list(run_dir: &Path) -> Vec<PathBuf> {
    let dir = checkpoints_dir(run_dir);
    let mut names = step_names(&dir);
    names.sort();
    names.into_iter().rev().map(|n| dir.join(n)).collect()
}

/// What `verify` found in one checkpoint.
#[derive(Debug, Clone)]
pub struct Verified {
    pub step: u64,
    pub bytes: u64,
}

/// Reads every file of a checkpoint and checks it against the manifest, then parses the
/// safetensors headers and the trainer state.
pub fn verify(ckpt: &Path) -> Result<Verified> {
    let manifest = read_manifest(ckpt)?;
    for name in [MODEL_FILE, OPTIMIZER_FILE] {
        let bytes = read_verified(ckpt, &manifest, name)?;
        SafeTensors::deserialize(&bytes).map_err(|e| {
            KilnError::checkpoint(ckpt.join(name), format!("is not valid safetensors ({e})"))
        })?;
    }
    let meta = read_meta_with(ckpt, &manifest)?;
    Ok(Verified {
        step: meta.state.step,
        bytes: manifest.files.iter().map(|f| f.bytes).sum(),
    })
}

/// The advice for a damaged checkpoint of `run_dir`: which other checkpoints verify and how
/// to select one.
pub fn alternatives(run_dir: &Path, bad: &Path) -> String {
    let good: Vec<String> = list(run_dir)
        .into_iter()
        .filter(|c| c != bad && verify(c).is_ok())
        .filter_map(|c| c.file_name()?.to_str().map(String::from))
        .collect();
    match good.first() {
        Some(first) => format!(
            "checkpoints of this run that verify: {}; select one with --checkpoint {first} (kiln train --resume, eval, generate)",
            good.join(", ")
        ),
        None => "no other checkpoint of this run verifies; start a new run".into(),
    }
}

/// Adds [`alternatives`] to a checkpoint error when the checkpoint itself is damaged (not
/// when it is merely of another model or precision).
pub fn explain(err: KilnError, run_dir: &Path, ckpt: &Path) -> KilnError {
    match err {
        KilnError::Checkpoint { path, reason } if verify(ckpt).is_err() => KilnError::Checkpoint {
            path,
            reason: format!("{reason}; {}", alternatives(run_dir, ckpt)),
        },
        other => other,
    }
}

/// The checkpoint to read: `choice` (`step_N`, `N`, or a checkpoint directory's name) or the
/// one `latest` points to. A missing choice, a dangling pointer or no checkpoint at all is a
/// checkpoint error that lists what there is.
pub fn resolve(run_dir: &Path, choice: Option<&str>) -> Result<PathBuf> {
    let dir = checkpoints_dir(run_dir);
    let have = || {
        let names: Vec<String> = list(run_dir)
            .iter()
            .filter_map(|c| c.file_name()?.to_str().map(String::from))
            .collect();
        if names.is_empty() {
            "the run has no checkpoints".to_string()
        } else {
            format!("the run has {}", names.join(", "))
        }
    };
    if let Some(choice) = choice {
        let digits = choice.strip_prefix("step_").unwrap_or(choice);
        let step: u64 = digits.parse().map_err(|_| {
            KilnError::Setting(format!(
                "--checkpoint {choice}: expected step_N or N (a step number); {}",
                have()
            ))
        })?;
        let ckpt = dir.join(step_name(step));
        if !ckpt.is_dir() {
            return Err(KilnError::checkpoint(
                &ckpt,
                format!("does not exist; {}", have()),
            ));
        }
        return Ok(ckpt);
    }
    match latest(run_dir)? {
        Some(ckpt) if ckpt.is_dir() => Ok(ckpt),
        Some(ckpt) => Err(KilnError::checkpoint(
            dir.join(LATEST),
            format!(
                "points to {}, which does not exist; {}",
                ckpt.display(),
                alternatives(run_dir, &ckpt)
            ),
        )),
        // A process killed between renaming its first checkpoint into place and writing the
        // pointer leaves a complete checkpoint (directories are renamed only once written)
        // and no pointer: the newest checkpoint is the one it was about to point to.
        None => list(run_dir)
            .into_iter()
            .next()
            .ok_or_else(|| KilnError::checkpoint(&dir, format!("has no checkpoint ({})", have()))),
    }
}

/// The trainer state and model shape of a checkpoint, verified against its manifest.
pub fn read_meta(ckpt: &Path) -> Result<CheckpointMeta> {
    read_meta_with(ckpt, &read_manifest(ckpt)?)
}

fn read_meta_with(ckpt: &Path, manifest: &Manifest) -> Result<CheckpointMeta> {
    let path = ckpt.join(STATE_FILE);
    let bytes = read_verified(ckpt, manifest, STATE_FILE)?;
    let meta: CheckpointMeta = serde_json::from_slice(&bytes).map_err(|e| {
        KilnError::checkpoint(&path, format!("is damaged or not a kiln checkpoint ({e})"))
    })?;
    if meta.format_version != FORMAT_VERSION {
        return Err(KilnError::checkpoint(
            &path,
            format!(
                "format version {} is not supported (this kiln reads {FORMAT_VERSION})",
                meta.format_version
            ),
        ));
    }
    Ok(meta)
}

/// Names every model dimension that differs between a checkpoint and the configured model.
fn shape_differences(saved: &CheckpointMeta, model: &ModelConfig, vocab: usize) -> Vec<String> {
    let (s, m) = (&saved.model, model);
    [
        (
            "model.d_model",
            s.d_model.to_string(),
            m.d_model.to_string(),
        ),
        (
            "model.n_layers",
            s.n_layers.to_string(),
            m.n_layers.to_string(),
        ),
        (
            "model.n_heads",
            s.n_heads.to_string(),
            m.n_heads.to_string(),
        ),
        (
            "model.context",
            s.context.to_string(),
            m.context.to_string(),
        ),
        (
            "model.tied_head",
            s.tied_head.to_string(),
            m.tied_head.to_string(),
        ),
        ("model.kind", s.kind.clone(), m.kind.clone()),
        (
            "model.moe_experts",
            s.moe_experts.to_string(),
            m.moe_experts.to_string(),
        ),
        (
            "model.moe_hidden (resolved)",
            s.moe_hidden_width().to_string(),
            m.moe_hidden_width().to_string(),
        ),
        (
            "vocabulary (data.tokenizer)",
            saved.vocab.to_string(),
            vocab.to_string(),
        ),
    ]
    .into_iter()
    .filter(|(_, a, b)| a != b)
    .map(|(name, a, b)| format!("{name}: checkpoint {a}, configured {b}"))
    .collect()
}

/// Reads a safetensors file and copies each tensor into `targets` (name -> tensor), checking
/// that names and shapes match exactly.
fn load_tensors(
    ckpt: &Path,
    manifest: &Manifest,
    name: &str,
    targets: &mut [(String, &mut Tensor)],
) -> Result<()> {
    let path = &ckpt.join(name);
    let bytes = read_verified(ckpt, manifest, name)?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| KilnError::checkpoint(path, format!("is not valid safetensors ({e})")))?;
    if st.len() != targets.len() {
        return Err(KilnError::checkpoint(
            path,
            format!(
                "holds {} tensors, the model has {}",
                st.len(),
                targets.len()
            ),
        ));
    }
    for (name, t) in targets.iter_mut() {
        let view = st.tensor(name).map_err(|_| {
            KilnError::checkpoint(
                path,
                format!("has no tensor '{name}'; it belongs to a different model"),
            )
        })?;
        if view.dtype() != Dtype::F32 || view.shape() != t.shape() {
            return Err(KilnError::checkpoint(
                path,
                format!(
                    "tensor '{name}' is {:?} {:?}, the model needs F32 {:?}",
                    view.dtype(),
                    view.shape(),
                    t.shape()
                ),
            ));
        }
        let values: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        t.copy_from_host(&values)?;
    }
    Ok(())
}

/// Loads the model weights only (for eval and generation) into `model`.
pub fn load_weights(
    ckpt: &Path,
    model: &mut dyn Model,
    model_cfg: &ModelConfig,
    vocab: usize,
) -> Result<CheckpointMeta> {
    let manifest = read_manifest(ckpt)?;
    let meta = read_meta_with(ckpt, &manifest)?;
    let diffs = shape_differences(&meta, model_cfg, vocab);
    if !diffs.is_empty() {
        return Err(KilnError::checkpoint(
            ckpt,
            format!("belongs to a model of another shape ({})", diffs.join("; ")),
        ));
    }
    let mut params = model.trainable_params_mut();
    let mut targets: Vec<(String, &mut Tensor)> = params
        .iter_mut()
        .map(|p| (p.name.clone(), &mut p.value))
        .collect();
    load_tensors(ckpt, &manifest, MODEL_FILE, &mut targets)?;
    for p in params {
        p.refresh_compute()?;
    }
    Ok(meta)
}

/// Restores a trainer completely (weights, optimizer moments, step, scaler, and the
/// out-of-memory split when the memory is the same as when it was learned).
pub fn load_into(trainer: &mut Trainer, ckpt: &Path) -> Result<()> {
    let vocab = trainer.vocab;
    let model_cfg = trainer.cfg.model.clone();
    let meta = load_weights(ckpt, trainer.model.as_mut(), &model_cfg, vocab)?;
    let names: Vec<String> = trainer
        .model
        .trainable_params()
        .iter()
        .map(|p| p.name.clone())
        .collect();
    let mut targets: Vec<(String, &mut Tensor)> = Vec::new();
    for ((n, m), v) in names
        .iter()
        .zip(trainer.opt.m.iter_mut())
        .zip(trainer.opt.v.iter_mut())
    {
        targets.push((format!("exp_avg.{n}"), m));
        targets.push((format!("exp_avg_sq.{n}"), v));
    }
    load_tensors(ckpt, &read_manifest(ckpt)?, OPTIMIZER_FILE, &mut targets)?;
    if meta.state.scaler.is_some() != trainer.state.scaler.is_some() {
        return Err(KilnError::checkpoint(
            ckpt,
            "was written with another train.precision (loss scaling differs); resume with the precision it was trained with",
        ));
    }
    trainer.state = meta.state;
    trainer.opt.t = meta.adam_t;
    // Kept under the same memory, so the resumed run does not run out again to learn it (a
    // wasted attempt at the first step); with another cap or device it is learned afresh,
    // so more memory is used in full.
    trainer.passes = match meta.learned_passes {
        Some(l) if l.capacity_bytes == trainer.pool.capacity() => PassSize::resumed(l.rows),
        _ => PassSize::default(),
    };
    Ok(())
}
