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
//! Checkpoints with manifests are format version 2. Version 1 checkpoints were written before
//! manifests existed (late ones have one, and are verified like version 2). A version 1
//! checkpoint without a manifest is read unverified, with a warning, since nothing recorded
//! what its files should hold; `kiln verify --adopt` writes a manifest for it from its files
//! as they are. A version 2 checkpoint without a manifest is damaged and refused.
//!
//! Beside a GPU the state is gathered into page-locked staging ([`HostStaging`], allocated
//! once per run and sized to the checkpoint): every device-to-host copy is queued and waited
//! for once, and the writer thread writes each safetensors file as its header followed by the
//! staged bytes, in the layout `safetensors::serialize` gives (tensors ordered by name), so
//! the files are byte for byte those of the pageable path. The staging goes to the writer
//! thread with the snapshot and comes back with the finished write; the CPU keeps the
//! pageable path, its tensors being host memory already.
//!
//! The files do not depend on where the optimizer keeps its state: with
//! `train.offload_optimizer` the masters and moments are read from and restored into host
//! memory under the same names, so a run may switch offload on or off when it resumes.

use super::oom::PassSize;
use super::trainer::{TrainState, Trainer};
use crate::config::{ModelConfig, ResnetBkSettings};
use crate::engine::staging::HostStaging;
use crate::engine::{Device, Tensor};
use crate::error::{KilnError, Result};
use crate::models::Model;
use crate::train::metrics::format_bytes;
use safetensors::tensor::{Dtype, Metadata, SafeTensors, TensorInfo, TensorView};
use serde::{Deserialize, Serialize};
use std::fs;
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// The version this kiln writes: every checkpoint carries a manifest.
const FORMAT_VERSION: u32 = 2;
/// Checkpoints written before manifests existed (and a few after, with one).
const LEGACY_FORMAT_VERSION: u32 = 1;
const MODEL_FILE: &str = "model.safetensors";
const OPTIMIZER_FILE: &str = "optimizer.safetensors";
const STATE_FILE: &str = "trainer.json";
pub const MANIFEST_FILE: &str = "manifest.json";
const LATEST: &str = "latest";
/// The file naming the checkpoint of the lowest validation loss (`train.keep_best`), which
/// pruning keeps; `--checkpoint best` reads it.
const BEST: &str = "best";
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
    /// The matrix-multiply algorithm chosen for each product on the GPU: a resumed run
    /// adopts them, so its products round as the run's did (absent on the CPU and in
    /// checkpoints written before it was kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gemm_algorithms: Option<crate::engine::cuda::GemmAlgorithms>,
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
    /// The format version of the checkpoint it describes.
    pub format_version: u32,
    /// Always "crc32" (IEEE, as zlib): fast enough to check gigabytes at load.
    pub hash: String,
    pub files: Vec<ManifestEntry>,
    /// Written afterwards by `kiln verify --adopt` for a checkpoint that had none: it vouches
    /// for the files as they were then, not as they were first written.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub adopted: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ManifestEntry {
    pub name: String,
    pub bytes: u64,
    /// Lower-case hex, 8 digits.
    pub crc32: String,
}

/// The CRC-32 of the concatenation of `parts`.
fn crc_hex(parts: &[&[u8]]) -> String {
    let mut h = crc32fast::Hasher::new();
    for p in parts {
        h.update(p);
    }
    format!("{:08x}", h.finalize())
}

/// What a damaged checkpoint's error says to do next (the caller adds the run's checkpoints
/// that verify when it knows the run directory).
const DAMAGED_HINT: &str = "the file is damaged";

/// How the files of a checkpoint are checked as they are read.
enum Integrity {
    /// Against the sizes and CRC-32s of its manifest.
    Manifest(Manifest),
    /// Not at all: a version 1 checkpoint written before manifests existed.
    Legacy,
}

/// How to check `ckpt`: its manifest, or nothing for a legacy checkpoint that has none. A
/// missing manifest is legacy only when the trainer state says version 1; otherwise the
/// checkpoint was not completely written, or its manifest was lost.
fn integrity(ckpt: &Path) -> Result<Integrity> {
    let path = ckpt.join(MANIFEST_FILE);
    match fs::metadata(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        _ => return read_manifest(ckpt).map(Integrity::Manifest),
    }
    let missing = |why: String| {
        KilnError::checkpoint(
            ckpt,
            format!("has no {MANIFEST_FILE}: {why}; {DAMAGED_HINT}"),
        )
    };
    let state = fs::read(ckpt.join(STATE_FILE)).map_err(|e| {
        missing(format!(
            "the checkpoint was not completely written ({STATE_FILE}: {e})"
        ))
    })?;
    let version = serde_json::from_slice::<serde_json::Value>(&state)
        .ok()
        .and_then(|v| v.get("format_version")?.as_u64());
    match version {
        Some(v) if v == u64::from(LEGACY_FORMAT_VERSION) => Ok(Integrity::Legacy),
        Some(v) => Err(missing(format!(
            "every checkpoint of format version {v} has one, so it was not completely written or the manifest was removed"
        ))),
        None => Err(missing(format!(
            "the checkpoint was not completely written ({STATE_FILE} names no format version)"
        ))),
    }
}

/// What a reader says about a checkpoint it loaded without verifying it.
pub fn legacy_warning(ckpt: &Path) -> Option<String> {
    let run_dir = ckpt.parent().and_then(Path::parent).unwrap_or(ckpt);
    matches!(integrity(ckpt), Ok(Integrity::Legacy)).then(|| {
        format!(
            "checkpoint {} has no manifest (format version 1, written before checkpoints were verified), so its files cannot be checked; `kiln verify {} --adopt` records them as they are now",
            ckpt.display(),
            run_dir.display()
        )
    })
}

fn read_manifest(ckpt: &Path) -> Result<Manifest> {
    let path = ckpt.join(MANIFEST_FILE);
    let text = fs::read_to_string(&path).map_err(|e| {
        KilnError::checkpoint(
            ckpt,
            format!("cannot read {MANIFEST_FILE} ({e}): the checkpoint was not completely written"),
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

/// Reads `name` from `ckpt` and checks its size and CRC-32 against the manifest, if the
/// checkpoint has one.
fn read_verified(ckpt: &Path, integrity: &Integrity, name: &str) -> Result<Vec<u8>> {
    let path = ckpt.join(name);
    let read = || {
        fs::read(&path).map_err(|e| {
            KilnError::checkpoint(
                &path,
                format!("cannot read ({e}); the checkpoint is incomplete"),
            )
        })
    };
    let manifest = match integrity {
        Integrity::Manifest(m) => m,
        Integrity::Legacy => return read(),
    };
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
    let bytes = read()?;
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
    let crc = crc_hex(&[&bytes]);
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

/// Writes the concatenation of `parts` to `path` and syncs it.
fn write_synced(path: &Path, parts: &[&[u8]]) -> Result<()> {
    let mut f = fs::File::create(path).map_err(|e| KilnError::output(path, e))?;
    parts
        .iter()
        .try_for_each(|p| f.write_all(p))
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

/// The header of a safetensors file of f32 `tensors` already in file order (by name): the
/// header length as a little-endian u64, then the JSON padded with spaces to 8 bytes, as
/// `safetensors::serialize` writes it, so that header and the tensors' bytes make the file.
fn safetensors_header(tensors: &[(String, &Tensor)]) -> Result<Vec<u8>> {
    let internal = |e: &dyn std::fmt::Display| {
        KilnError::Setting(format!("internal: safetensors header: {e}"))
    };
    let mut offset = 0;
    let infos = tensors
        .iter()
        .map(|(name, t)| {
            let n = t.len() * size_of::<f32>();
            offset += n;
            let info = TensorInfo {
                dtype: Dtype::F32,
                shape: t.shape().to_vec(),
                data_offsets: (offset - n, offset),
            };
            (name.clone(), info)
        })
        .collect();
    let metadata = Metadata::new(None, infos).map_err(|e| internal(&e))?;
    let mut json = serde_json::to_string(&metadata)
        .map_err(|e| internal(&e))?
        .into_bytes();
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut header = (json.len() as u64).to_le_bytes().to_vec();
    header.extend(json);
    Ok(header)
}

/// One file of a snapshot: its leading bytes, then a range of the staging buffer (empty on
/// the pageable path, which holds each file whole in `head`).
struct SnapshotFile {
    name: &'static str,
    head: Vec<u8>,
    staged: Range<usize>,
}

impl SnapshotFile {
    fn whole(name: &'static str, bytes: Vec<u8>) -> SnapshotFile {
        SnapshotFile {
            name,
            head: bytes,
            staged: 0..0,
        }
    }
}

/// A checkpoint copied to host memory at a step boundary, ready to be written by any thread.
pub struct Snapshot {
    pub step: u64,
    /// The checkpoint of the best validation loss so far (`train.keep_best`): once written,
    /// `checkpoints/best` names it and pruning keeps it.
    pub best: bool,
    name: String,
    files: Vec<SnapshotFile>,
    /// The page-locked buffer the tensors were gathered into, if they were.
    staging: Option<HostStaging>,
}

impl Snapshot {
    /// Bytes the checkpoint takes on disk (its manifest aside).
    pub fn bytes(&self) -> usize {
        self.files
            .iter()
            .map(|f| f.head.len() + f.staged.len())
            .sum()
    }

    /// Whether the tensors went through page-locked staging (rather than pageable memory).
    pub fn pinned(&self) -> bool {
        self.staging.is_some()
    }

    /// A file's bytes, in the order they are written.
    fn parts<'a>(&'a self, f: &'a SnapshotFile) -> [&'a [u8]; 2] {
        let staged = self
            .staging
            .as_ref()
            .map_or(&[][..], |s| &s.as_bytes()[f.staged.clone()]);
        [&f.head, staged]
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

/// The tensors of the checkpoint's two safetensors files, under the names they are saved as.
/// Only what trains is saved: every weight, or the adapters over a frozen base (which
/// `lora.base` names and the run's init_from.json pins by hash).
fn checkpoint_tensors(trainer: &Trainer) -> [(&'static str, Vec<(String, &Tensor)>); 2] {
    let params = trainer.model.trainable_params();
    let model = params.iter().map(|p| (p.name.clone(), &p.value)).collect();
    let mut opt: Vec<(String, &Tensor)> = Vec::new();
    for (i, p) in params.iter().enumerate() {
        let (m, v) = trainer.opt.moments_of(i);
        opt.push((format!("exp_avg.{}", p.name), m));
        opt.push((format!("exp_avg_sq.{}", p.name), v));
    }
    [(MODEL_FILE, model), (OPTIMIZER_FILE, opt)]
}

/// Bytes of tensor data in a checkpoint of `trainer` (what its staging must hold).
fn tensor_bytes(trainer: &Trainer) -> usize {
    // From the parameters, not the moments at hand: under ZeRO this rank holds only some of
    // them, and the checkpoint gathers the rest.
    let values: usize = trainer
        .model
        .trainable_params()
        .iter()
        .map(|p| p.value.len())
        .sum();
    3 * values * size_of::<f32>()
}

/// Copies the trainer's weights, optimizer moments and state into pageable host memory, one
/// tensor at a time.
pub fn snapshot(trainer: &Trainer) -> Result<Snapshot> {
    let mut files = Vec::new();
    for (name, tensors) in checkpoint_tensors(trainer) {
        files.push(SnapshotFile::whole(name, serialize(tensors)?));
    }
    files.push(SnapshotFile::whole(STATE_FILE, state_json(trainer)?));
    Ok(Snapshot {
        step: trainer.state.step,
        best: false,
        name: step_name(trainer.state.step),
        files,
        staging: None,
    })
}

/// Copies the trainer's weights and optimizer moments into `staging` (all copies queued, one
/// synchronisation), each file's tensors in the order its safetensors layout puts them.
pub fn snapshot_staged(trainer: &Trainer, mut staging: HostStaging) -> Result<Snapshot> {
    let mut sets = checkpoint_tensors(trainer);
    for (_, tensors) in &mut sets {
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
    }
    let all: Vec<&Tensor> = sets
        .iter()
        .flat_map(|(_, ts)| ts.iter().map(|(_, t)| *t))
        .collect();
    let ranges = staging.gather(&all)?;
    let mut files = Vec::new();
    let mut next = 0;
    for (name, tensors) in &sets {
        let mine = &ranges[next..next + tensors.len()];
        next += tensors.len();
        let start = mine.first().map_or(0, |r| r.start);
        files.push(SnapshotFile {
            name,
            head: safetensors_header(tensors)?,
            staged: start..mine.last().map_or(start, |r| r.end),
        });
    }
    files.push(SnapshotFile::whole(STATE_FILE, state_json(trainer)?));
    Ok(Snapshot {
        step: trainer.state.step,
        best: false,
        name: step_name(trainer.state.step),
        files,
        staging: Some(staging),
    })
}

/// Page-locked staging sized to the checkpoint of a trainer on a GPU, allocated once for the
/// run. `Ok(None)` on the CPU, whose tensors are host memory already; `Err` with a one-line
/// notice when it cannot be had (more than half of the available RAM, or refused by the
/// driver), in which case checkpoints are copied through pageable memory as before.
pub fn pinned_staging(trainer: &Trainer) -> std::result::Result<Option<HostStaging>, String> {
    if trainer.pool.device() == Device::Cpu {
        return Ok(None);
    }
    let bytes = tensor_bytes(trainer);
    let fallback = "checkpoints are copied to host memory through pageable memory instead, which stalls training longer";
    if let Some(available) = crate::hw::cpu::detect_ram().available_bytes
        && bytes as u64 > available / 2
    {
        return Err(format!(
            "checkpoints of {} would pin more than half of the {} of RAM available; {fallback}",
            format_bytes(bytes),
            format_bytes(available as usize)
        ));
    }
    HostStaging::pinned(&trainer.pool, bytes)
        .map(Some)
        .map_err(|e| {
            format!(
                "{} of page-locked memory for checkpoints could not be allocated ({e}); {fallback}",
                format_bytes(bytes)
            )
        })
}

/// The trainer state and model shape as `trainer.json` holds them.
fn state_json(trainer: &Trainer) -> Result<Vec<u8>> {
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
        gemm_algorithms: trainer.pool.cuda().ok().map(|g| g.gemm_algorithms()),
    };
    serde_json::to_vec_pretty(&meta)
        .map_err(|e| KilnError::Setting(format!("internal: trainer state to JSON: {e}")))
}

pub fn step_name(step: u64) -> String {
    format!("step_{step:07}")
}

/// Held by every checkpoint write from its first file to its `latest` pointer, so that a
/// process which must exit from another thread (a peer rank died) can wait for the write in
/// flight instead of leaving a checkpoint without its pointer.
static WRITING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Waits for the checkpoint write in flight, if any, and keeps any other from starting: call
/// it right before `std::process::exit` from a thread other than the training loop's.
pub fn finish_writes_before_exit() -> std::sync::MutexGuard<'static, ()> {
    WRITING.lock().unwrap_or_else(|e| e.into_inner())
}

/// Writes a snapshot under `run_dir`: files and manifest into a temporary directory, each
/// synced, then renamed into place, then the `latest` pointer replaced by rename. On failure
/// the temporary files are removed and the previous checkpoint and pointer are untouched.
pub fn write(snap: &Snapshot, run_dir: &Path) -> Result<Written> {
    let _writing = WRITING.lock().unwrap_or_else(|e| e.into_inner());
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
    if snap.best {
        // Named only once the checkpoint is in place, so `best` never names a partial one.
        let best_tmp = dir.join(".best.tmp");
        write_synced(&best_tmp, &[snap.name.as_bytes()])?;
        fs::rename(&best_tmp, dir.join(BEST)).map_err(|e| KilnError::output(dir.join(BEST), e))?;
    }
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
        adopted: false,
    };
    for f in &snap.files {
        let parts = snap.parts(f);
        write_synced(&tmp.join(f.name), &parts)?;
        manifest.files.push(ManifestEntry {
            name: f.name.to_string(),
            bytes: parts.iter().map(|p| p.len() as u64).sum(),
            crc32: crc_hex(&parts),
        });
    }
    let json = serde_json::to_vec_pretty(&manifest).map_err(|e| KilnError::output(tmp, e))?;
    write_synced(&tmp.join(MANIFEST_FILE), &[&json])?;
    let final_dir = dir.join(&snap.name);
    let _ = fs::remove_dir_all(&final_dir);
    fs::rename(tmp, &final_dir).map_err(|e| KilnError::output(&final_dir, e))?;
    write_synced(pointer_tmp, &[snap.name.as_bytes()])?;
    fs::rename(pointer_tmp, dir.join(LATEST))
        .map_err(|e| KilnError::output(dir.join(LATEST), e))?;
    // The renames are durable only once the directory itself is synced.
    if let Ok(d) = fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(final_dir)
}

/// What the writer thread hands back: the finished write, and the staging buffer the snapshot
/// was gathered into, free for the next one.
type Finished = (Result<Written>, Option<HostStaging>);

/// Writes checkpoints on a background thread so training goes on while they reach the disk.
///
/// At most one write is in flight, and the next snapshot waits for it ([`Writer::wait`]
/// before [`Writer::snapshot`]): the write reads the staging buffer the next snapshot fills,
/// host memory holds one copy of the state beside the one being written at most, and
/// checkpoints land in step order.
pub struct Writer {
    run_dir: PathBuf,
    in_flight: Option<std::thread::JoinHandle<Finished>>,
    /// Page-locked staging when the run has it, here while no write is reading it.
    staging: Option<HostStaging>,
}

impl Writer {
    /// A writer for `run_dir`, gathering snapshots into `staging` when given one.
    pub fn new(run_dir: &Path, staging: Option<HostStaging>) -> Writer {
        Writer {
            run_dir: run_dir.to_path_buf(),
            in_flight: None,
            staging,
        }
    }

    /// Waits for the write in flight, if any, and returns what it wrote.
    pub fn wait(&mut self) -> Result<Option<Written>> {
        let Some(handle) = self.in_flight.take() else {
            return Ok(None);
        };
        match handle.join() {
            Ok((result, staging)) => {
                self.staging = self.staging.take().or(staging);
                result.map(Some)
            }
            Err(_) => Err(KilnError::output(
                checkpoints_dir(&self.run_dir),
                "the checkpoint writer thread panicked",
            )),
        }
    }

    /// Copies the trainer's state to host memory: through the staging buffer when the writer
    /// has one, else through pageable memory. Call [`Writer::wait`] first: the write in
    /// flight may still be reading the staging.
    pub fn snapshot(&mut self, trainer: &Trainer) -> Result<Snapshot> {
        if self.in_flight.is_some() {
            return Err(KilnError::Setting(
                "internal: a checkpoint snapshot was taken while the previous write was in flight"
                    .into(),
            ));
        }
        match self.staging.take() {
            Some(staging) => snapshot_staged(trainer, staging),
            None => snapshot(trainer),
        }
    }

    /// Starts writing `snap` once the previous write is done; returns the previous write.
    pub fn submit(&mut self, snap: Snapshot) -> Result<Option<Written>> {
        let previous = self.wait()?;
        let run_dir = self.run_dir.clone();
        let handle = std::thread::Builder::new()
            .name("kiln-checkpoint".into())
            .spawn(move || {
                let written = write(&snap, &run_dir);
                (written, snap.staging)
            })
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

/// Suffix of a checkpoint directory that [`prune`] renamed out of the way and is deleting.
pub const DELETING_SUFFIX: &str = ".deleting";

/// Deletes all but the newest `keep` checkpoints; failures only leave extra files behind. Each
/// is first renamed to a hidden name (one atomic step) and deleted there, so a process stopped
/// part-way through a deletion (a rank's exit after a peer died, a kill) leaves no
/// half-deleted checkpoint under a step name, only a hidden directory that no reader looks at
/// and the next prune removes.
fn prune(dir: &Path, keep: usize) {
    let mut names = step_names(dir);
    names.sort();
    let best = best_name(dir);
    for old in names.iter().rev().skip(keep) {
        if best.as_deref() == Some(old.as_str()) {
            continue;
        }
        let doomed = dir.join(format!(".{old}{DELETING_SUFFIX}"));
        if fs::rename(dir.join(old), &doomed).is_ok() {
            let _ = fs::remove_dir_all(&doomed);
        }
    }
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        if n.starts_with('.') && n.ends_with(DELETING_SUFFIX) {
            let _ = fs::remove_dir_all(e.path());
        }
    }
}

/// The checkpoint name `checkpoints/best` holds, if it holds one.
fn best_name(dir: &Path) -> Option<String> {
    let name = fs::read_to_string(dir.join(BEST)).ok()?;
    let name = name.trim();
    name.starts_with("step_").then(|| name.to_string())
}

/// The checkpoint of the lowest validation loss a `train.keep_best` run kept, if any.
pub fn best(run_dir: &Path) -> Option<PathBuf> {
    let dir = checkpoints_dir(run_dir);
    best_name(&dir).map(|n| dir.join(n))
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

/// How far `verify` could check a checkpoint it accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Checked {
    /// Every file against the manifest written with it.
    Manifest,
    /// Against a manifest `kiln verify --adopt` wrote later, from the files as they were then.
    Adopted,
    /// Its structure only (safetensors headers and lengths, trainer state): a version 1
    /// checkpoint without a manifest, so a changed value inside a file goes unnoticed.
    Legacy,
}

/// What `verify` found in one checkpoint.
#[derive(Debug, Clone)]
pub struct Verified {
    pub step: u64,
    pub bytes: u64,
    pub checked: Checked,
}

/// Reads every file of a checkpoint and checks it against the manifest, then parses the
/// safetensors headers and the trainer state. A legacy checkpoint (version 1, no manifest)
/// gets the parsing only, and says so in [`Verified::checked`].
pub fn verify(ckpt: &Path) -> Result<Verified> {
    let integrity = integrity(ckpt)?;
    let mut bytes = 0;
    for name in [MODEL_FILE, OPTIMIZER_FILE] {
        let data = read_verified(ckpt, &integrity, name)?;
        SafeTensors::deserialize(&data).map_err(|e| {
            KilnError::checkpoint(ckpt.join(name), format!("is not valid safetensors ({e})"))
        })?;
        bytes += data.len() as u64;
    }
    let meta = read_meta_with(ckpt, &integrity)?;
    let (bytes, checked) = match &integrity {
        Integrity::Manifest(m) => (
            m.files.iter().map(|f| f.bytes).sum(),
            if m.adopted {
                Checked::Adopted
            } else {
                Checked::Manifest
            },
        ),
        Integrity::Legacy => {
            let state = fs::metadata(ckpt.join(STATE_FILE)).map_or(0, |m| m.len());
            (bytes + state, Checked::Legacy)
        }
    };
    Ok(Verified {
        step: meta.state.step,
        bytes,
        checked,
    })
}

/// Writes a manifest for a legacy checkpoint (version 1, none of its own) from its files as
/// they are, once they pass the checks [`verify`] can make without one; from then on every
/// read is verified against it. This trusts the files: damage done before adoption is
/// recorded as if it were the checkpoint. Returns false, writing nothing, for a checkpoint
/// that has a manifest. The manifest is written to a temporary name, synced and renamed.
pub fn adopt(ckpt: &Path) -> Result<bool> {
    if let Integrity::Manifest(_) = integrity(ckpt)? {
        return Ok(false);
    }
    verify(ckpt)?;
    let mut manifest = Manifest {
        format_version: LEGACY_FORMAT_VERSION,
        hash: "crc32".into(),
        files: Vec::new(),
        adopted: true,
    };
    for name in DATA_FILES {
        let path = ckpt.join(name);
        let bytes = fs::read(&path).map_err(|e| KilnError::checkpoint(&path, e.to_string()))?;
        manifest.files.push(ManifestEntry {
            name: name.to_string(),
            bytes: bytes.len() as u64,
            crc32: crc_hex(&[&bytes]),
        });
    }
    let json = serde_json::to_vec_pretty(&manifest).map_err(|e| KilnError::output(ckpt, e))?;
    let tmp = ckpt.join(format!(".{MANIFEST_FILE}.tmp"));
    let placed = write_synced(&tmp, &[&json]).and_then(|_| {
        fs::rename(&tmp, ckpt.join(MANIFEST_FILE))
            .map_err(|e| KilnError::output(ckpt.join(MANIFEST_FILE), e))
    });
    if placed.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    placed?;
    if let Ok(d) = fs::File::open(ckpt) {
        let _ = d.sync_all();
    }
    Ok(true)
}

/// The advice for a damaged checkpoint of `run_dir`: which other checkpoints verify and how
/// to select one.
pub fn alternatives(run_dir: &Path, bad: &Path) -> String {
    let mut names = Vec::new();
    let mut shown = Vec::new();
    for c in list(run_dir).into_iter().filter(|c| c != bad) {
        let (Ok(v), Some(name)) = (verify(&c), c.file_name().and_then(|n| n.to_str())) else {
            continue;
        };
        shown.push(match v.checked {
            Checked::Legacy => format!("{name} (legacy, unverified)"),
            _ => name.to_string(),
        });
        names.push(name.to_string());
    }
    match names.first() {
        Some(first) => format!(
            "checkpoints of this run that verify: {}; select one with --checkpoint {first} (kiln train --resume, eval, generate)",
            shown.join(", ")
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

/// The checkpoint to read: `choice` (`step_N`, `N`, `best`, or a checkpoint directory's name) or the
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
    if choice == Some("best") {
        return match best(run_dir) {
            Some(ckpt) if ckpt.is_dir() => Ok(ckpt),
            Some(ckpt) => Err(KilnError::checkpoint(
                &ckpt,
                format!(
                    "is named by checkpoints/best but does not exist; {}",
                    have()
                ),
            )),
            None => Err(KilnError::Setting(format!(
                "--checkpoint best: the run kept no best checkpoint (train.keep_best=true with train.eval_every keeps the one of the lowest validation loss); {}",
                have()
            ))),
        };
    }
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

/// The trainer state and model shape of a checkpoint, verified against its manifest (read
/// as it is from a legacy checkpoint without one).
pub fn read_meta(ckpt: &Path) -> Result<CheckpointMeta> {
    read_meta_with(ckpt, &integrity(ckpt)?)
}

fn read_meta_with(ckpt: &Path, integrity: &Integrity) -> Result<CheckpointMeta> {
    let path = ckpt.join(STATE_FILE);
    let bytes = read_verified(ckpt, integrity, STATE_FILE)?;
    let meta: CheckpointMeta = serde_json::from_slice(&bytes).map_err(|e| {
        KilnError::checkpoint(&path, format!("is damaged or not a kiln checkpoint ({e})"))
    })?;
    match meta.format_version {
        LEGACY_FORMAT_VERSION | FORMAT_VERSION => Ok(meta),
        v if v > FORMAT_VERSION => Err(KilnError::checkpoint(
            &path,
            format!(
                "format version {v} is newer than this kiln reads ({LEGACY_FORMAT_VERSION} and {FORMAT_VERSION}); read it with the kiln that wrote it or a newer one"
            ),
        )),
        v => Err(KilnError::checkpoint(
            &path,
            format!(
                "format version {v} is not supported (this kiln reads {LEGACY_FORMAT_VERSION} and {FORMAT_VERSION})"
            ),
        )),
    }
}

/// Names every model dimension that differs between a checkpoint and the configured model.
fn shape_differences(saved: &CheckpointMeta, model: &ModelConfig, vocab: usize) -> Vec<String> {
    let (s, m) = (&saved.model, model);
    // Another kind is reported as such; its experts (none, or some) are not compared.
    let both_resnet_bk = s.resnet_bk().is_some() && m.resnet_bk().is_some();
    let moe = |c: &ModelConfig, value: fn(&ResnetBkSettings, usize) -> usize| {
        c.resnet_bk()
            .filter(|_| both_resnet_bk)
            .map_or_else(String::new, |r| value(r, c.d_model).to_string())
    };
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
        ("model.kind", s.kind().into(), m.kind().into()),
        (
            "model.moe_experts",
            moe(s, |r, _| r.moe_experts),
            moe(m, |r, _| r.moe_experts),
        ),
        (
            "model.moe_hidden (resolved)",
            moe(s, ResnetBkSettings::moe_hidden_width),
            moe(m, ResnetBkSettings::moe_hidden_width),
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
    integrity: &Integrity,
    name: &str,
    targets: &mut [(String, &mut Tensor)],
) -> Result<()> {
    load_tensors_of(ckpt, integrity, name, targets, false)
}

/// [`load_tensors`], or with `subset` only the tensors `targets` names out of more.
fn load_tensors_of(
    ckpt: &Path,
    integrity: &Integrity,
    name: &str,
    targets: &mut [(String, &mut Tensor)],
    subset: bool,
) -> Result<()> {
    let path = &ckpt.join(name);
    let bytes = read_verified(ckpt, integrity, name)?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| KilnError::checkpoint(path, format!("is not valid safetensors ({e})")))?;
    if !subset && st.len() != targets.len() {
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
    let integrity = integrity(ckpt)?;
    let meta = read_meta_with(ckpt, &integrity)?;
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
    load_tensors(ckpt, &integrity, MODEL_FILE, &mut targets)?;
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
    let owned: Vec<bool> = (0..names.len()).map(|i| trainer.opt.owns(i)).collect();
    let sharded = owned.iter().any(|o| !o);
    let mut targets: Vec<(String, &mut Tensor)> = Vec::new();
    for (((n, m), v), own) in names
        .iter()
        .zip(trainer.opt.m.iter_mut())
        .zip(trainer.opt.v.iter_mut())
        .zip(owned)
    {
        // Under ZeRO this rank restores the moments it owns; the checkpoint holds them all,
        // whatever number of ranks wrote it.
        if own {
            targets.push((format!("exp_avg.{n}"), m));
            targets.push((format!("exp_avg_sq.{n}"), v));
        }
    }
    load_tensors_of(
        ckpt,
        &integrity(ckpt)?,
        OPTIMIZER_FILE,
        &mut targets,
        sharded,
    )?;
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
    // The products' algorithms are timed when first met, and two processes may time them
    // differently: adopting the run's keeps its rounding.
    if let (Some(saved), Ok(gpu)) = (&meta.gemm_algorithms, trainer.pool.cuda())
        && let Err(why) = gpu.adopt_gemm_algorithms(saved)
    {
        eprintln!(
            "note: the checkpoint's matrix-multiply algorithms were {why}; they are chosen again, so the resumed run may differ from an uninterrupted one in the last bits"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ResolvedConfig;
    use crate::engine::{DType, MemoryPool};
    use crate::train::Precision;

    /// Old checkpoints leave under a hidden name first: an interrupted deletion (here, a
    /// hidden directory already holding part of a checkpoint) is invisible to readers and gone
    /// after the next prune, and only the newest `keep` step directories remain.
    #[test]
    fn prune_renames_before_deleting_and_clears_interrupted_deletions() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        for step in 1..=4 {
            let d = dir.join(step_name(step));
            fs::create_dir_all(&d).unwrap();
            fs::write(d.join("model.safetensors"), b"x").unwrap();
        }
        let half = dir.join(format!(".{}{DELETING_SUFFIX}", step_name(0)));
        fs::create_dir_all(&half).unwrap();
        fs::write(half.join("model.safetensors"), b"x").unwrap();
        let mut seen = step_names(dir);
        seen.sort();
        assert_eq!(seen, (1..=4).map(step_name).collect::<Vec<_>>());
        prune(dir, 2);
        let mut left: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(left, vec![step_name(3), step_name(4)]);
        // The checkpoint `best` names stays, however old; the others go as before.
        for step in 5..=6 {
            fs::create_dir_all(dir.join(step_name(step))).unwrap();
        }
        fs::write(dir.join(BEST), step_name(3)).unwrap();
        prune(dir, 2);
        let mut left = step_names(dir);
        left.sort();
        assert_eq!(left, vec![step_name(3), step_name(5), step_name(6)]);
    }

    /// A tiny CPU trainer whose weights are seeded and whose moments hold distinct values
    /// (never zeros, so a moment written to the wrong place shows).
    fn trainer() -> Trainer {
        let overrides: Vec<String> = [
            "model.d_model=32",
            "model.n_layers=2",
            "model.n_heads=2",
            "model.context=16",
            "train.seq_len=16",
            "train.micro_batch=2",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let cfg = ResolvedConfig::resolve(None, &overrides).unwrap().config;
        let vocab = crate::train::model_vocab(&cfg).unwrap();
        let pool = MemoryPool::new(crate::engine::Device::Cpu);
        let mut t = Trainer::new(&cfg, vocab, &pool, Precision::Fp32).unwrap();
        let mut k = 0.0f32;
        for moments in [&mut t.opt.m, &mut t.opt.v] {
            for m in moments.iter_mut() {
                let values: Vec<f32> = (0..m.len()).map(|i| k + i as f32 * 1e-3).collect();
                m.copy_from_host(&values).unwrap();
                k += 1.0;
            }
        }
        t.state.step = 3;
        t
    }

    /// A checkpoint's weights, under kiln's own names, build the model they came from
    /// through a parameter builder: every parameter found, none left over, equal values.
    /// The trainer state keeps a GPU's matrix-multiply algorithms through JSON, and a state
    /// written without them (on the CPU, or before they were kept) reads as none.
    #[test]
    fn trainer_state_keeps_the_gemm_algorithm_table() {
        let t = trainer();
        let mut meta: CheckpointMeta = serde_json::from_slice(&state_json(&t).unwrap()).unwrap();
        assert!(meta.gemm_algorithms.is_none(), "none on the CPU");
        let text = serde_json::to_string(&meta).unwrap();
        assert!(!text.contains("gemm_algorithms"));
        meta.gemm_algorithms = Some(crate::engine::cuda::GemmAlgorithms {
            gpu: "NVIDIA H100 80GB HBM3".into(),
            cublaslt: 130100,
            table: vec![("ShapeKey { m: 8 }".into(), [1, 2, 3, 4, 5, 6, 7, u64::MAX])],
        });
        let back: CheckpointMeta =
            serde_json::from_str(&serde_json::to_string(&meta).unwrap()).unwrap();
        assert_eq!(back.gemm_algorithms, meta.gemm_algorithms);
    }

    #[test]
    fn a_checkpoint_builds_its_model_through_a_param_builder() {
        use crate::models::gpt::{Gpt, GptConfig};
        use crate::nn::ParamBuilder;
        use crate::nn::builder::{NameMap, WeightSource};
        let t = trainer();
        let tmp = tempfile::tempdir().unwrap();
        let ckpt = save(&t, tmp.path()).unwrap();
        let path = ckpt.join(MODEL_FILE);
        let tensors =
            crate::models::import::pretrained::read_safetensors(std::slice::from_ref(&path))
                .unwrap();
        let mut source = WeightSource::new(path.display(), &tensors, NameMap::identity());
        // The shape `trainer()` sets.
        let cfg = GptConfig {
            vocab: t.vocab,
            d_model: 32,
            n_layers: 2,
            n_heads: 2,
            context: 16,
            tied_head: true,
        };
        let built = Gpt::build(&mut ParamBuilder::load(&t.pool, &mut source), cfg).unwrap();
        source.finish().unwrap();
        let described = |m: &dyn Model| -> Vec<(String, Vec<f32>)> {
            m.params()
                .iter()
                .map(|p| (p.name.clone(), p.value.to_vec().unwrap()))
                .collect()
        };
        assert_eq!(described(&built), described(t.model.as_ref()));
    }

    fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
        let mut v: Vec<(String, Vec<u8>)> = fs::read_dir(dir)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let name = e.file_name().to_string_lossy().into_owned();
                (name, fs::read(e.path()).unwrap())
            })
            .collect();
        v.sort();
        v
    }

    #[test]
    fn the_staged_header_and_bytes_make_the_file_safetensors_serialize_makes() {
        let pool = MemoryPool::new(crate::engine::Device::Cpu);
        let t = |shape: &[usize], at: f32| {
            let n: usize = shape.iter().product();
            let values = (0..n).map(|i| at + i as f32).collect();
            Tensor::from_vec(&pool, shape, DType::F32, values).unwrap()
        };
        let (a, b, c) = (t(&[3, 2], 1.0), t(&[5], -7.5), t(&[1, 1, 2], 1e20));
        // Names whose byte order differs from their numeric order, given out of order.
        let given: Vec<(String, &Tensor)> = vec![
            ("blocks.10.w".into(), &a),
            ("blocks.2.w".into(), &b),
            ("a".into(), &c),
        ];
        let expected = serialize(given.clone()).unwrap();
        let mut sorted = given;
        sorted.sort_by(|x, y| x.0.cmp(&y.0));
        let mut made = safetensors_header(&sorted).unwrap();
        for (_, t) in &sorted {
            made.extend(t.to_vec().unwrap().iter().flat_map(|v| v.to_le_bytes()));
        }
        assert_eq!(made, expected);
    }

    #[test]
    fn a_staged_checkpoint_is_byte_identical_to_a_pageable_one() {
        let t = trainer();
        let tmp = tempfile::tempdir().unwrap();
        let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
        let pageable = write(&snapshot(&t).unwrap(), &a).unwrap();
        // Larger than needed and dirty, as a buffer reused across saves is.
        let mut staging = HostStaging::pageable(tensor_bytes(&t) + 64);
        let dirty = Tensor::from_vec(&t.pool, &[16], DType::F32, vec![f32::NAN; 16]).unwrap();
        staging.gather(&[&dirty]).unwrap();
        let snap = snapshot_staged(&t, staging).unwrap();
        assert!(snap.pinned());
        let staged = write(&snap, &b).unwrap();
        assert_eq!(staged.bytes, pageable.bytes);
        assert_eq!(files(&staged.dir), files(&pageable.dir));
        assert_eq!(verify(&staged.dir).unwrap().checked, Checked::Manifest);
    }

    #[test]
    fn the_writer_hands_the_staging_back_for_the_next_save() {
        let mut t = trainer();
        let tmp = tempfile::tempdir().unwrap();
        let staging = HostStaging::pageable(tensor_bytes(&t));
        let mut writer = Writer::new(tmp.path(), Some(staging));
        for step in [1, 2] {
            t.state.step = step;
            let snap = writer.snapshot(&t).unwrap();
            assert!(snap.pinned(), "save {step} went through the staging");
            assert!(writer.submit(snap).unwrap().is_none());
            assert!(writer.snapshot(&t).is_err(), "a write is in flight");
            let w = writer.wait().unwrap().unwrap();
            assert_eq!(w.step, step);
            assert_eq!(verify(&w.dir).unwrap().step, step);
        }
        assert_eq!(list(tmp.path()).len(), 2);
    }

    /// A checkpoint as kiln wrote them before manifests: no manifest.json, version 1.
    fn make_legacy(ckpt: &Path) {
        fs::remove_file(ckpt.join(MANIFEST_FILE)).unwrap();
        let p = ckpt.join(STATE_FILE);
        let text = fs::read_to_string(&p).unwrap();
        assert!(text.contains("\"format_version\": 2,"), "{text}");
        fs::write(
            &p,
            text.replace("\"format_version\": 2,", "\"format_version\": 1,"),
        )
        .unwrap();
    }

    #[test]
    fn a_legacy_checkpoint_loads_unverified_and_verifies_once_adopted() {
        let t = trainer();
        let tmp = tempfile::tempdir().unwrap();
        let ckpt = save(&t, tmp.path()).unwrap();
        assert!(legacy_warning(&ckpt).is_none());
        make_legacy(&ckpt);
        let v = verify(&ckpt).unwrap();
        assert_eq!((v.checked, v.step), (Checked::Legacy, 3));
        assert!(legacy_warning(&ckpt).unwrap().contains("cannot be checked"));
        let mut model = crate::models::build(&t.cfg.model, t.vocab, &t.pool, 99).unwrap();
        load_weights(&ckpt, model.as_mut(), &t.cfg.model, t.vocab).unwrap();
        let loaded: Vec<Vec<f32>> = model
            .params()
            .iter()
            .map(|p| p.value.to_vec().unwrap())
            .collect();
        let saved: Vec<Vec<f32>> = t
            .model
            .params()
            .iter()
            .map(|p| p.value.to_vec().unwrap())
            .collect();
        assert_eq!(loaded, saved);

        assert!(adopt(&ckpt).unwrap());
        assert!(!adopt(&ckpt).unwrap(), "a manifest is there now");
        assert_eq!(verify(&ckpt).unwrap().checked, Checked::Adopted);
        assert!(legacy_warning(&ckpt).is_none());
        // From now on the adopted manifest catches damage.
        let p = ckpt.join(OPTIMIZER_FILE);
        let mut bytes = fs::read(&p).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x40;
        fs::write(&p, bytes).unwrap();
        let err = verify(&ckpt).unwrap_err().to_string();
        assert!(err.contains("does not match its manifest"), "{err}");
    }

    #[test]
    fn a_broken_legacy_checkpoint_is_refused_and_not_adopted() {
        let t = trainer();
        let tmp = tempfile::tempdir().unwrap();
        let ckpt = save(&t, tmp.path()).unwrap();
        make_legacy(&ckpt);
        let p = ckpt.join(MODEL_FILE);
        let bytes = fs::read(&p).unwrap();
        fs::write(&p, &bytes[..bytes.len() - 5]).unwrap();
        let err = verify(&ckpt).unwrap_err().to_string();
        assert!(err.contains("not valid safetensors"), "{err}");
        assert!(adopt(&ckpt).is_err());
        assert!(!ckpt.join(MANIFEST_FILE).exists());
    }

    #[test]
    fn a_current_checkpoint_without_its_manifest_is_damaged_not_legacy() {
        let t = trainer();
        let tmp = tempfile::tempdir().unwrap();
        let ckpt = save(&t, tmp.path()).unwrap();
        fs::remove_file(ckpt.join(MANIFEST_FILE)).unwrap();
        let err = verify(&ckpt).unwrap_err().to_string();
        assert!(err.contains("format version 2 has one"), "{err}");
        assert!(adopt(&ckpt).is_err());
        assert!(legacy_warning(&ckpt).is_none());
    }

    #[test]
    fn a_newer_format_version_is_refused_by_name() {
        let t = trainer();
        let tmp = tempfile::tempdir().unwrap();
        let ckpt = save(&t, tmp.path()).unwrap();
        let p = ckpt.join(STATE_FILE);
        let text = fs::read_to_string(&p)
            .unwrap()
            .replace("\"format_version\": 2,", "\"format_version\": 3,");
        fs::write(&p, &text).unwrap();
        // Re-recorded in the manifest, so the version, not the checksum, is what is refused.
        let mut manifest = read_manifest(&ckpt).unwrap();
        let entry = manifest
            .files
            .iter_mut()
            .find(|f| f.name == STATE_FILE)
            .unwrap();
        entry.bytes = text.len() as u64;
        entry.crc32 = crc_hex(&[text.as_bytes()]);
        fs::write(
            ckpt.join(MANIFEST_FILE),
            serde_json::to_vec(&manifest).unwrap(),
        )
        .unwrap();
        let err = read_meta(&ckpt).unwrap_err().to_string();
        assert!(err.contains("format version 3 is newer"), "{err}");
    }
}
