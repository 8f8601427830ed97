//! `kiln nf4-export` (not listed in `--help`): quantises raw f32 values to NF4 on the host and
//! writes the parts of [`crate::engine::quant::nf4`]'s layout as raw little-endian files, so
//! that a script can compare kiln's quantisation with bitsandbytes' (`bench/nf4_gpu_check.sh`).

use crate::engine::cpu::nf4;
use crate::engine::quant::Nf4Weight;
use crate::engine::{Device, MemoryPool};
use crate::error::{KilnError, Result};
use clap::Args;
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  kiln nf4-export --input w.f32 --rows 2048 --cols 8192 --out nf4-w

Writes into --out: packed.u8 (32 bytes per block of 64 values, high nibble first),
absmax_codes.u8, absmax_scales.f32, offset.f32, nf4_code.f32 (16 values), dynamic_map.f32
(256 values) and dequantized.f32 (rows x cols).")]
pub struct Nf4ExportArgs {
    /// Raw little-endian f32 values of a row-major [rows, cols] weight.
    #[arg(long)]
    pub input: PathBuf,
    #[arg(long)]
    pub rows: usize,
    #[arg(long)]
    pub cols: usize,
    /// Directory for the parts (created if missing).
    #[arg(long)]
    pub out: PathBuf,
}

pub fn run(a: Nf4ExportArgs) -> Result<()> {
    let raw = std::fs::read(&a.input)
        .map_err(|e| KilnError::Setting(format!("--input {}: {e}", a.input.display())))?;
    let want = a.rows * a.cols * 4;
    if raw.len() != want || want == 0 {
        return Err(KilnError::Setting(format!(
            "--input {} holds {} bytes; a [{}, {}] f32 weight is {want} bytes (rows and cols at least 1)",
            a.input.display(),
            raw.len(),
            a.rows,
            a.cols
        )));
    }
    let values: Vec<f32> = raw
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let name = a.input.display().to_string();
    let pool = MemoryPool::new(Device::Cpu);
    let w = Nf4Weight::quantize(&pool, &name, &values, a.rows, a.cols)?;
    let parts = w.to_host_parts()?;
    std::fs::create_dir_all(&a.out).map_err(|e| KilnError::output(&a.out, e))?;
    let f32s = |xs: &[f32]| xs.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let files: [(&str, Vec<u8>); 7] = [
        ("packed.u8", parts.packed.clone()),
        ("absmax_codes.u8", parts.absmax_codes.clone()),
        ("absmax_scales.f32", f32s(&parts.absmax_scales)),
        ("offset.f32", f32s(&[parts.offset])),
        ("nf4_code.f32", f32s(&nf4::NF4_CODE)),
        ("dynamic_map.f32", f32s(nf4::dynamic_map())),
        ("dequantized.f32", f32s(&w.to_host_f32()?)),
    ];
    for (file, bytes) in files {
        write(&a.out.join(file), &bytes)?;
    }
    println!(
        "{} values in {} blocks: {} bytes in {}",
        values.len(),
        parts.absmax_codes.len(),
        w.bytes(),
        a.out.display()
    );
    Ok(())
}

fn write(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).map_err(|e| KilnError::output(path, e))
}
