//! Checkpoints: weights and optimizer state as safetensors (readable by PyTorch), trainer
//! state and the model's shape as JSON.
//!
//! A checkpoint is a directory `checkpoints/step_NNNNNNN/`. It is written under a temporary
//! name, every file is synced, and only then is it renamed into place and the `latest` pointer
//! replaced (itself by rename). A failed write, a full disk included, therefore never touches
//! the last good checkpoint. Loading checks the model shape before reading any tensor, so a
//! checkpoint of another model fails with a message that says which dimension differs.
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
const LATEST: &str = "latest";
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

/// Writes the trainer's checkpoint under `run_dir` and returns its directory.
pub fn save(trainer: &Trainer, run_dir: &Path) -> Result<PathBuf> {
    let dir = checkpoints_dir(run_dir);
    let name = format!("step_{:07}", trainer.state.step);
    let tmp = dir.join(format!(".{name}.tmp"));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp).map_err(|e| KilnError::output(&tmp, e))?;

    let params = trainer.model.params();
    let model = serialize(params.iter().map(|p| (p.name.clone(), &p.value)).collect())?;
    write_synced(&tmp.join(MODEL_FILE), &model)?;
    let mut opt: Vec<(String, &Tensor)> = Vec::new();
    for ((p, m), v) in params.iter().zip(&trainer.opt.m).zip(&trainer.opt.v) {
        opt.push((format!("exp_avg.{}", p.name), m));
        opt.push((format!("exp_avg_sq.{}", p.name), v));
    }
    write_synced(&tmp.join(OPTIMIZER_FILE), &serialize(opt)?)?;
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
    let json = serde_json::to_vec_pretty(&meta).map_err(|e| KilnError::output(&tmp, e))?;
    write_synced(&tmp.join(STATE_FILE), &json)?;

    let final_dir = dir.join(&name);
    let _ = fs::remove_dir_all(&final_dir);
    fs::rename(&tmp, &final_dir).map_err(|e| KilnError::output(&final_dir, e))?;
    let pointer_tmp = dir.join(".latest.tmp");
    write_synced(&pointer_tmp, name.as_bytes())?;
    fs::rename(&pointer_tmp, dir.join(LATEST))
        .map_err(|e| KilnError::output(dir.join(LATEST), e))?;
    prune(&dir, KEEP);
    Ok(final_dir)
}

/// Deletes all but the newest `keep` checkpoints; failures only leave extra files behind.
fn prune(dir: &Path, keep: usize) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("step_"))
        .collect();
    names.sort();
    for old in names.iter().rev().skip(keep) {
        let _ = fs::remove_dir_all(dir.join(old));
    }
}

pub fn read_meta(ckpt: &Path) -> Result<CheckpointMeta> {
    let path = ckpt.join(STATE_FILE);
    let text = fs::read_to_string(&path)
        .map_err(|e| KilnError::checkpoint(&path, format!("cannot read: {e}")))?;
    let meta: CheckpointMeta = serde_json::from_str(&text).map_err(|e| {
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
fn load_tensors(path: &Path, targets: &mut [(String, &mut Tensor)]) -> Result<()> {
    let bytes =
        fs::read(path).map_err(|e| KilnError::checkpoint(path, format!("cannot read: {e}")))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| {
        KilnError::checkpoint(
            path,
            format!("is truncated or damaged ({e}); use an earlier checkpoint or start a new run"),
        )
    })?;
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
    let meta = read_meta(ckpt)?;
    let diffs = shape_differences(&meta, model_cfg, vocab);
    if !diffs.is_empty() {
        return Err(KilnError::checkpoint(
            ckpt,
            format!("belongs to a model of another shape ({})", diffs.join("; ")),
        ));
    }
    let mut params = model.params_mut();
    let mut targets: Vec<(String, &mut Tensor)> = params
        .iter_mut()
        .map(|p| (p.name.clone(), &mut p.value))
        .collect();
    load_tensors(&ckpt.join(MODEL_FILE), &mut targets)?;
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
        .params()
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
    load_tensors(&ckpt.join(OPTIMIZER_FILE), &mut targets)?;
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
