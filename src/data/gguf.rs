//! GGUF, llama.cpp's single-file model format: typed metadata, a tensor directory, and tensor
//! data in ggml's block-quantised layouts.
//!
//! The file is memory-mapped, so opening a multi-gigabyte model reads only its header; tensors
//! are dequantised to f32 one at a time on request. Every length and offset in the header is
//! checked against the file's size before it is used, so a truncated or damaged file gives an
//! [`ImportError`] naming what is cut off, never a panic or an out-of-bounds read.
//!
//! Layout (little-endian): magic `GGUF`, version (2 or 3), tensor count (u64), metadata count
//! (u64), the metadata entries (key string, value type, value), the tensor infos (name, number
//! of dimensions, dimensions fastest-varying first, ggml type, offset), padding to
//! `general.alignment`, then the tensor data, each tensor at its offset from the data start.

use super::ImportError;
use half::{bf16, f16};
use memmap2::Mmap;
use rayon::prelude::*;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// Arrays of arrays are legal; a bound keeps a hostile file from exhausting the stack.
const MAX_NESTING: usize = 8;

/// One metadata value. Strings that are not valid UTF-8 are kept with U+FFFD in place of the
/// bad bytes (llama.cpp treats them as bytes; no published model relies on that).
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
}

impl GgufValue {
    /// Any integer that is not negative.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer that fits an i64.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::U64(v) => i64::try_from(v).ok(),
            GgufValue::I8(v) => Some(v.into()),
            GgufValue::I16(v) => Some(v.into()),
            GgufValue::I32(v) => Some(v.into()),
            GgufValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// Any float or integer.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }

    /// The GGUF name of the value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            GgufValue::U8(_) => "uint8",
            GgufValue::I8(_) => "int8",
            GgufValue::U16(_) => "uint16",
            GgufValue::I16(_) => "int16",
            GgufValue::U32(_) => "uint32",
            GgufValue::I32(_) => "int32",
            GgufValue::U64(_) => "uint64",
            GgufValue::I64(_) => "int64",
            GgufValue::F32(_) => "float32",
            GgufValue::F64(_) => "float64",
            GgufValue::Bool(_) => "bool",
            GgufValue::String(_) => "string",
            GgufValue::Array(_) => "array",
        }
    }
}

/// A ggml tensor type, by its number in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GgmlType(pub u32);

impl GgmlType {
    pub const F32: GgmlType = GgmlType(0);
    pub const F16: GgmlType = GgmlType(1);
    pub const Q4_0: GgmlType = GgmlType(2);
    pub const Q4_1: GgmlType = GgmlType(3);
    pub const Q5_0: GgmlType = GgmlType(6);
    pub const Q5_1: GgmlType = GgmlType(7);
    pub const Q8_0: GgmlType = GgmlType(8);
    pub const Q2_K: GgmlType = GgmlType(10);
    pub const Q3_K: GgmlType = GgmlType(11);
    pub const Q4_K: GgmlType = GgmlType(12);
    pub const Q5_K: GgmlType = GgmlType(13);
    pub const Q6_K: GgmlType = GgmlType(14);
    pub const Q8_K: GgmlType = GgmlType(15);
    pub const IQ4_NL: GgmlType = GgmlType(20);
    pub const IQ4_XS: GgmlType = GgmlType(23);
    pub const BF16: GgmlType = GgmlType(30);

    /// ggml's name for the type ("Q4_K"), or "type N" for a number ggml does not define.
    pub fn name(self) -> String {
        let known = match self.0 {
            0 => "F32",
            1 => "F16",
            2 => "Q4_0",
            3 => "Q4_1",
            6 => "Q5_0",
            7 => "Q5_1",
            8 => "Q8_0",
            9 => "Q8_1",
            10 => "Q2_K",
            11 => "Q3_K",
            12 => "Q4_K",
            13 => "Q5_K",
            14 => "Q6_K",
            15 => "Q8_K",
            16 => "IQ2_XXS",
            17 => "IQ2_XS",
            18 => "IQ3_XXS",
            19 => "IQ1_S",
            20 => "IQ4_NL",
            21 => "IQ3_S",
            22 => "IQ2_S",
            23 => "IQ4_XS",
            24 => "I8",
            25 => "I16",
            26 => "I32",
            27 => "I64",
            28 => "F64",
            29 => "IQ1_M",
            30 => "BF16",
            34 => "TQ1_0",
            35 => "TQ2_0",
            39 => "MXFP4",
            n => return format!("type {n}"),
        };
        known.to_string()
    }

    /// (elements, bytes) of one block, for the types whose layout kiln knows; the others can
    /// be listed but not read.
    pub fn block_layout(self) -> Option<(usize, usize)> {
        Some(match self.0 {
            0 => (1, 4),
            1 | 30 => (1, 2),
            2 => (32, 18),
            3 => (32, 20),
            6 => (32, 22),
            7 => (32, 24),
            8 => (32, 34),
            9 => (32, 36),
            10 => (256, 84),
            11 => (256, 110),
            12 => (256, 144),
            13 => (256, 176),
            14 => (256, 210),
            15 => (256, 292),
            20 => (32, 18),
            23 => (256, 136),
            24 => (1, 1),
            25 => (1, 2),
            26 => (1, 4),
            27 | 28 => (1, 8),
            _ => return None,
        })
    }

    /// Whether [`GgufFile::tensor_f32`] can dequantise this type.
    pub fn is_dequantisable(self) -> bool {
        [
            Self::F32,
            Self::F16,
            Self::BF16,
            Self::Q8_0,
            Self::Q4_0,
            Self::Q4_1,
            Self::Q5_0,
            Self::Q5_1,
            Self::Q2_K,
            Self::Q3_K,
            Self::Q4_K,
            Self::Q5_K,
            Self::Q6_K,
            Self::Q8_K,
            Self::IQ4_NL,
            Self::IQ4_XS,
        ]
        .contains(&self)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

/// One entry of the tensor directory.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// Dimensions as GGUF lists them: fastest-varying first (ggml's `ne`).
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Byte offset from the start of the data section.
    pub offset: u64,
}

impl GgufTensorInfo {
    /// The shape in row-major order, as PyTorch and Hugging Face see it: GGUF's dimensions
    /// reversed (`ne = [576, 49152]` is a `[49152, 576]` matrix).
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// The type's ggml name ("Q4_1").
    pub fn type_name(&self) -> String {
        self.ggml_type.name()
    }

    /// Bytes of data, when the type's block layout is known.
    fn byte_len(&self) -> Option<u64> {
        let (elems, bytes) = self.ggml_type.block_layout()?;
        (self.n_elements() / elems as u64).checked_mul(bytes as u64)
    }
}

/// An open GGUF file: its metadata and tensor directory, with the data memory-mapped.
pub struct GgufFile {
    path: PathBuf,
    map: Mmap,
    version: u32,
    alignment: u64,
    metadata: BTreeMap<String, GgufValue>,
    tensors: Vec<GgufTensorInfo>,
    by_name: HashMap<String, usize>,
    data_start: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Opens and checks `path`: the header parses, and every tensor the directory lists lies
    /// inside the file.
    pub fn open(path: &Path) -> Result<GgufFile, ImportError> {
        let io = |source| ImportError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len < MAGIC.len() as u64 {
            return Err(ImportError::Truncated {
                path: path.to_path_buf(),
                what: "the GGUF magic".into(),
                end: MAGIC.len() as u64,
                len,
            });
        }
        // SAFETY: the map is read-only and kiln never writes the file. Another process
        // truncating the file while it is mapped would fault on access; that is the same
        // contract every mmap-based model loader (llama.cpp, safetensors) accepts.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::parse(path.to_path_buf(), map)
    }

    fn parse(path: PathBuf, map: Mmap) -> Result<GgufFile, ImportError> {
        let mut r = Reader {
            buf: &map,
            pos: 0,
            path: &path,
        };
        let magic = r.take(4, "the GGUF magic")?;
        if magic != MAGIC {
            return Err(ImportError::Format {
                path: path.clone(),
                reason: format!(
                    "this is not a GGUF file (it starts with {magic:02x?}, not \"GGUF\"); \
                     Hugging Face directories hold config.json and *.safetensors instead"
                ),
            });
        }
        let version = r.u32("the GGUF version")?;
        if version != 2 && version != 3 {
            let hint = if version.swap_bytes() == 2 || version.swap_bytes() == 3 {
                "it is a big-endian GGUF, which kiln does not read; use the little-endian file"
            } else if version == 1 {
                "version 1 files predate 2023-08; convert it with a current llama.cpp"
            } else {
                "kiln reads versions 2 and 3; convert it with llama.cpp's tools"
            };
            return Err(ImportError::Format {
                path: path.clone(),
                reason: format!("GGUF version {version} is not supported: {hint}"),
            });
        }
        let n_tensors = r.u64("the tensor count")?;
        let n_kv = r.u64("the metadata count")?;

        let mut metadata = BTreeMap::new();
        for i in 0..n_kv {
            let key = r.string(&format!("metadata key {i}"))?;
            let ty = r.u32(&format!("the type of metadata {key}"))?;
            let value = r.value(ty, &key, 0)?;
            metadata.insert(key, value);
        }

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a.is_power_of_two() => a,
                _ => {
                    return Err(ImportError::Metadata {
                        path: path.clone(),
                        key: "general.alignment".into(),
                        reason: format!("{v:?} is not a power of two; the file is damaged"),
                    });
                }
            },
        };

        // Each tensor info takes at least 24 bytes; a count beyond that is a damaged header,
        // not a reason to reserve gigabytes.
        let mut tensors = Vec::with_capacity(n_tensors.min(r.remaining() / 24) as usize);
        let mut by_name = HashMap::new();
        for i in 0..n_tensors {
            let name = r.string(&format!("the name of tensor {i}"))?;
            let n_dims = r.u32(&format!("the rank of tensor {name}"))?;
            if n_dims > 8 {
                return Err(ImportError::Format {
                    path: path.clone(),
                    reason: format!(
                        "tensor {name} claims {n_dims} dimensions (ggml allows at most 4); the file is damaged"
                    ),
                });
            }
            let dims = (0..n_dims)
                .map(|_| r.u64(&format!("the dimensions of tensor {name}")))
                .collect::<Result<Vec<_>, _>>()?;
            let ggml_type = GgmlType(r.u32(&format!("the type of tensor {name}"))?);
            let offset = r.u64(&format!("the offset of tensor {name}"))?;
            let info = GgufTensorInfo {
                name,
                dims,
                ggml_type,
                offset,
            };
            check_tensor_info(&path, &info, alignment)?;
            if by_name.insert(info.name.clone(), tensors.len()).is_some() {
                return Err(ImportError::Format {
                    path: path.clone(),
                    reason: format!("tensor {} is listed twice; the file is damaged", info.name),
                });
            }
            tensors.push(info);
        }

        let data_start = (r.pos as u64).next_multiple_of(alignment);
        let len = map.len() as u64;
        for t in &tensors {
            if let Some(bytes) = t.byte_len() {
                let end = data_start
                    .checked_add(t.offset)
                    .and_then(|s| s.checked_add(bytes))
                    .unwrap_or(u64::MAX);
                if end > len {
                    return Err(ImportError::Truncated {
                        path: path.clone(),
                        what: format!("the data of tensor {}", t.name),
                        end,
                        len,
                    });
                }
            }
        }

        Ok(GgufFile {
            path,
            map,
            version,
            alignment,
            metadata,
            tensors,
            by_name,
            data_start,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The GGUF version, 2 or 3.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// `general.alignment`, or 32 when the file does not set it.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    pub fn metadata(&self) -> &BTreeMap<String, GgufValue> {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key)?.as_str()
    }

    /// Any non-negative integer type.
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key)?.as_u64()
    }

    /// Any float or integer type.
    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.get(key)?.as_f64()
    }

    pub fn get_bool(&self, key: &str) -> Option<bool> {
        self.get(key)?.as_bool()
    }

    /// An array of strings (`None` when absent, not an array, or holding anything else).
    pub fn get_str_array(&self, key: &str) -> Option<Vec<&str>> {
        self.get(key)?
            .as_array()?
            .iter()
            .map(|v| v.as_str())
            .collect()
    }

    /// An array of integers of any integer type.
    pub fn get_i64_array(&self, key: &str) -> Option<Vec<i64>> {
        self.get(key)?
            .as_array()?
            .iter()
            .map(|v| v.as_i64())
            .collect()
    }

    /// An array of floats or integers, as f32.
    pub fn get_f32_array(&self, key: &str) -> Option<Vec<f32>> {
        self.get(key)?
            .as_array()?
            .iter()
            .map(|v| v.as_f64().map(|x| x as f32))
            .collect()
    }

    /// `general.architecture` ("llama", "qwen2", ...).
    pub fn architecture(&self) -> Option<&str> {
        self.get_str("general.architecture")
    }

    /// Like [`get_u64`](Self::get_u64), but a missing or mistyped entry is an error that
    /// names the key.
    pub fn require_u64(&self, key: &str) -> Result<u64, ImportError> {
        self.get_u64(key)
            .ok_or_else(|| self.metadata_error(key, "a non-negative integer"))
    }

    /// Like [`get_f64`](Self::get_f64), but a missing or mistyped entry is an error.
    pub fn require_f64(&self, key: &str) -> Result<f64, ImportError> {
        self.get_f64(key)
            .ok_or_else(|| self.metadata_error(key, "a number"))
    }

    /// Like [`get_str`](Self::get_str), but a missing or mistyped entry is an error.
    pub fn require_str(&self, key: &str) -> Result<&str, ImportError> {
        self.get_str(key)
            .ok_or_else(|| self.metadata_error(key, "a string"))
    }

    fn metadata_error(&self, key: &str, wanted: &str) -> ImportError {
        let reason = match self.get(key) {
            None => format!(
                "is missing (wanted {wanted}); the file was not written for this model family or by a converter kiln knows"
            ),
            Some(v) => format!("is a {}, but kiln needs {wanted}", v.type_name()),
        };
        ImportError::Metadata {
            path: self.path.clone(),
            key: key.to_string(),
            reason,
        }
    }

    /// The tensor directory in file order.
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensors.iter().map(|t| t.name.as_str())
    }

    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    fn require_tensor(&self, name: &str) -> Result<&GgufTensorInfo, ImportError> {
        self.tensor_info(name).ok_or_else(|| {
            let mut some: Vec<&str> = self.tensor_names().take(4).collect();
            if self.tensors.len() > some.len() {
                some.push("...");
            }
            ImportError::MissingTensor {
                path: self.path.clone(),
                name: name.to_string(),
                hint: format!(
                    "the file has {} tensors ({}); check that it is the model family you asked for",
                    self.tensors.len(),
                    some.join(", ")
                ),
            }
        })
    }

    /// The raw bytes of tensor `name` in its ggml layout (for loaders that keep blocks
    /// quantised).
    pub fn tensor_data(&self, name: &str) -> Result<&[u8], ImportError> {
        let info = self.require_tensor(name)?;
        let bytes = info.byte_len().ok_or_else(|| self.unsupported(info))?;
        let start = self.data_start + info.offset;
        // `open` checked every tensor with a known layout against the file's length.
        Ok(&self.map[start as usize..(start + bytes) as usize])
    }

    /// Tensor `name` as f32 values with its row-major shape (GGUF's dimensions reversed, as
    /// PyTorch sees it): `token_embd.weight` with `ne = [576, 49152]` comes back as
    /// `[49152, 576]`.
    pub fn tensor_f32(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), ImportError> {
        let info = self.require_tensor(name)?;
        if !info.ggml_type.is_dequantisable() {
            return Err(self.unsupported(info));
        }
        let data = self.tensor_data(name)?;
        let mut out = vec![0f32; info.n_elements() as usize];
        dequantize(info.ggml_type, data, &mut out);
        Ok((info.shape(), out))
    }

    fn unsupported(&self, info: &GgufTensorInfo) -> ImportError {
        ImportError::UnsupportedType {
            path: self.path.clone(),
            tensor: info.name.clone(),
            dtype: info.type_name(),
        }
    }
}

/// Checks what can be checked of one tensor info on its own: its data offset is aligned and
/// its first dimension holds whole blocks.
fn check_tensor_info(path: &Path, t: &GgufTensorInfo, alignment: u64) -> Result<(), ImportError> {
    let bad = |reason: String| ImportError::Format {
        path: path.to_path_buf(),
        reason: format!("tensor {}: {reason}; the file is damaged", t.name),
    };
    if !t.offset.is_multiple_of(alignment) {
        return Err(bad(format!(
            "its offset {} is not a multiple of the alignment {alignment}",
            t.offset
        )));
    }
    let mut n: u64 = 1;
    for &d in &t.dims {
        n = n
            .checked_mul(d)
            .ok_or_else(|| bad(format!("its dimensions {:?} overflow", t.dims)))?;
    }
    if let Some((elems, _)) = t.ggml_type.block_layout() {
        let row = t.dims.first().copied().unwrap_or(1);
        if !row.is_multiple_of(elems as u64) {
            return Err(bad(format!(
                "its rows of {row} elements are not whole {} blocks of {elems}",
                t.ggml_type
            )));
        }
    }
    Ok(())
}

/// A bounds-checked cursor over the header.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], ImportError> {
        if n > self.remaining() {
            return Err(ImportError::Truncated {
                path: self.path.to_path_buf(),
                what: what.to_string(),
                end: self.pos as u64 + n,
                len: self.buf.len() as u64,
            });
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], ImportError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N as u64, what)?);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32, ImportError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, ImportError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> Result<String, ImportError> {
        let n = self.u64(what)?;
        let bytes = self.take(n, what)?;
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<GgufValue, ImportError> {
        let what = || format!("the value of metadata {key}");
        Ok(match ty {
            0 => GgufValue::U8(self.array::<1>(&what())?[0]),
            1 => GgufValue::I8(i8::from_le_bytes(self.array(&what())?)),
            2 => GgufValue::U16(u16::from_le_bytes(self.array(&what())?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array(&what())?)),
            4 => GgufValue::U32(u32::from_le_bytes(self.array(&what())?)),
            5 => GgufValue::I32(i32::from_le_bytes(self.array(&what())?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array(&what())?)),
            7 => {
                let b = self.array::<1>(&what())?[0];
                GgufValue::Bool(b != 0)
            }
            8 => GgufValue::String(self.string(&what())?),
            9 => {
                if depth >= MAX_NESTING {
                    return Err(ImportError::Format {
                        path: self.path.to_path_buf(),
                        reason: format!(
                            "metadata {key} nests arrays more than {MAX_NESTING} deep; the file is damaged"
                        ),
                    });
                }
                let elem = self.u32(&what())?;
                let n = self.u64(&what())?;
                // Every element takes at least one byte: a longer count is a cut-off file.
                if n > self.remaining() {
                    return Err(ImportError::Truncated {
                        path: self.path.to_path_buf(),
                        what: format!("the array {key} of {n} elements"),
                        end: self.pos as u64 + n,
                        len: self.buf.len() as u64,
                    });
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(elem, key, depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(u64::from_le_bytes(self.array(&what())?)),
            11 => GgufValue::I64(i64::from_le_bytes(self.array(&what())?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array(&what())?)),
            other => {
                return Err(ImportError::Format {
                    path: self.path.to_path_buf(),
                    reason: format!(
                        "metadata {key} has value type {other}, which GGUF does not define; the file is damaged or from a newer GGUF version"
                    ),
                });
            }
        })
    }
}

/// Blocks handed to one rayon task: large enough that scheduling is invisible.
const BLOCKS_PER_TASK: usize = 1024;

/// Dequantises `data` (whole blocks of `ty`, already length-checked) into `out`.
fn dequantize(ty: GgmlType, data: &[u8], out: &mut [f32]) {
    match ty {
        GgmlType::F32 => for_blocks(data, out, 4, 1, |b, y| {
            y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]])
        }),
        GgmlType::F16 => for_blocks(data, out, 2, 1, |b, y| y[0] = half_at(b, 0)),
        GgmlType::BF16 => for_blocks(data, out, 2, 1, |b, y| {
            y[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32()
        }),
        GgmlType::Q8_0 => for_blocks(data, out, 34, 32, dequant_q8_0),
        GgmlType::Q4_0 => for_blocks(data, out, 18, 32, dequant_q4_0),
        GgmlType::Q4_1 => for_blocks(data, out, 20, 32, dequant_q4_1),
        GgmlType::Q5_0 => for_blocks(data, out, 22, 32, dequant_q5_0),
        GgmlType::Q5_1 => for_blocks(data, out, 24, 32, dequant_q5_1),
        GgmlType::Q2_K => for_blocks(data, out, 84, 256, dequant_q2_k),
        GgmlType::Q3_K => for_blocks(data, out, 110, 256, dequant_q3_k),
        GgmlType::Q4_K => for_blocks(data, out, 144, 256, dequant_q4_k),
        GgmlType::Q5_K => for_blocks(data, out, 176, 256, dequant_q5_k),
        GgmlType::Q6_K => for_blocks(data, out, 210, 256, dequant_q6_k),
        GgmlType::Q8_K => for_blocks(data, out, 292, 256, dequant_q8_k),
        GgmlType::IQ4_NL => for_blocks(data, out, 18, 32, dequant_iq4_nl),
        GgmlType::IQ4_XS => for_blocks(data, out, 136, 256, dequant_iq4_xs),
        _ => unreachable!("tensor_f32 checks is_dequantisable first"),
    }
}

fn for_blocks(
    data: &[u8],
    out: &mut [f32],
    block_bytes: usize,
    block_elems: usize,
    f: impl Fn(&[u8], &mut [f32]) + Sync,
) {
    out.par_chunks_mut(block_elems * BLOCKS_PER_TASK)
        .zip(data.par_chunks(block_bytes * BLOCKS_PER_TASK))
        .for_each(|(y, x)| {
            for (yb, xb) in y
                .chunks_exact_mut(block_elems)
                .zip(x.chunks_exact(block_bytes))
            {
                f(xb, yb);
            }
        });
}

fn half_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Q8_0: an f16 scale, then 32 signed bytes; `x = d * q`.
fn dequant_q8_0(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    for (y, &q) in y.iter_mut().zip(&b[2..34]) {
        *y = d * f32::from(q as i8);
    }
}

/// Q4_0: an f16 scale, then 16 bytes of 4-bit codes: element `i` is byte `i`'s low nibble,
/// element `i + 16` its high nibble; `x = d * (q - 8)`.
fn dequant_q4_0(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    for (i, &q) in b[2..18].iter().enumerate() {
        y[i] = d * (f32::from(q & 0x0f) - 8.0);
        y[i + 16] = d * (f32::from(q >> 4) - 8.0);
    }
}

/// Q4_1: f16 scale and minimum, then nibbles as in Q4_0; `x = d * q + m`.
fn dequant_q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (half_at(b, 0), half_at(b, 2));
    for (i, &q) in b[4..20].iter().enumerate() {
        y[i] = d * f32::from(q & 0x0f) + m;
        y[i + 16] = d * f32::from(q >> 4) + m;
    }
}

/// The 5-bit codes of elements `i` and `i + 16` (0..16) of a Q5_0 or Q5_1 block: the low 4
/// bits are nibbles as in Q4_0 (`qs` byte `i`, low then high), the fifth bit is bit `i` or
/// `i + 16` of `qh`, the block's 4 high-bit bytes read as one little-endian word.
fn q5_codes(qs: &[u8], qh: u32, i: usize) -> (u8, u8) {
    let top = |bit: usize| (((qh >> bit) & 1) as u8) << 4;
    ((qs[i] & 0x0f) | top(i), (qs[i] >> 4) | top(i + 16))
}

/// Q5_0: an f16 scale, 4 bytes holding the fifth bit of each of the 32 codes, then 16 bytes
/// of low nibbles (see [`q5_codes`]); `x = d * (q - 16)`.
fn dequant_q5_0(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for i in 0..16 {
        let (lo, hi) = q5_codes(qs, qh, i);
        y[i] = d * (f32::from(lo) - 16.0);
        y[i + 16] = d * (f32::from(hi) - 16.0);
    }
}

/// Q5_1: f16 scale and minimum, then the fifth-bit word and nibbles as in Q5_0;
/// `x = d * q + m`.
fn dequant_q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (half_at(b, 0), half_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for i in 0..16 {
        let (lo, hi) = q5_codes(qs, qh, i);
        y[i] = d * f32::from(lo) + m;
        y[i + 16] = d * f32::from(hi) + m;
    }
}

/// Q2_K: 256 elements in 16 sub-blocks of 16. 16 bytes of 4-bit scale (low nibble) and
/// minimum (high nibble), one byte per sub-block; 64 bytes of 2-bit codes; then f16 `d` and
/// `dmin`. Each half of 128 elements has 32 code bytes, and bit pair `k` (bits `2k..2k+2`) of
/// its byte `l` is the half's element `32 k + l`. `x = d * scale * q - dmin * min`.
fn dequant_q2_k(b: &[u8], y: &mut [f32]) {
    let (sc, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (half_at(b, 80), half_at(b, 82));
    for (s, y) in y.chunks_exact_mut(16).enumerate() {
        let (dl, ml) = (d * f32::from(sc[s] & 0x0f), dmin * f32::from(sc[s] >> 4));
        let q = &qs[(s / 8) * 32 + (s % 2) * 16..][..16];
        let shift = 2 * ((s % 8) / 2);
        for (y, &q) in y.iter_mut().zip(q) {
            *y = dl * f32::from((q >> shift) & 3) - ml;
        }
    }
}

/// The signed scale of Q3_K sub-block `s` (0..16): 6 bits stored with an offset of 32 in 12
/// bytes. The low 4 bits are a nibble of the first 8 bytes (low nibbles for sub-blocks 0-7,
/// high nibbles for 8-15, byte `s % 8`), the top 2 bits the bit pair `s / 4` of byte
/// `8 + s % 4`.
fn q3_k_scale(s: usize, sc: &[u8]) -> i8 {
    let low = (sc[s % 8] >> (4 * (s / 8))) & 0x0f;
    let high = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
    (low | (high << 4)) as i8 - 32
}

/// Q3_K: 256 elements in 16 sub-blocks of 16, no minimum. 32 bytes of high bits (`hmask`),
/// 64 bytes of 2-bit low codes laid out as in Q2_K, 12 bytes of packed scales (see
/// [`q3_k_scale`]), then f16 `d`. Element `32 j + l` (`j` in 0..8, `l` in 0..32) takes its
/// third bit from bit `j` of `hmask` byte `l`; a set bit means the code is the low bits as
/// they are, a clear one subtracts 4, so codes run from -4 to 3. `x = d * scale * q`.
fn dequant_q3_k(b: &[u8], y: &mut [f32]) {
    let (hmask, qs, sc) = (&b[0..32], &b[32..96], &b[96..108]);
    let d = half_at(b, 108);
    for (s, y) in y.chunks_exact_mut(16).enumerate() {
        let dl = d * f32::from(q3_k_scale(s, sc));
        let l0 = (s % 2) * 16;
        let (q, hm) = (&qs[(s / 8) * 32 + l0..][..16], &hmask[l0..][..16]);
        let j = s / 2;
        let shift = 2 * (j % 4);
        for ((y, &q), &h) in y.iter_mut().zip(q).zip(hm) {
            let low = ((q >> shift) & 3) as i8;
            let code = if (h >> j) & 1 == 1 { low } else { low - 4 };
            *y = dl * f32::from(code);
        }
    }
}

/// The 6-bit scale and minimum of Q4_K (and Q5_K) sub-block `j` (0..8), packed in 12 bytes:
/// sub-blocks 0-3 keep theirs in the low 6 bits of bytes j and j+4; sub-blocks 4-7 keep their
/// low 4 bits in byte j+4 (scale low nibble, minimum high nibble) and their top 2 bits in the
/// spare top bits of bytes j-4 and j.
fn q4_k_scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Q4_K: 256 elements in 8 sub-blocks of 32. f16 `d` and `dmin`, 12 bytes of packed 6-bit
/// scales and minimums, 128 bytes of nibbles: each 32-byte group holds two sub-blocks (low
/// nibbles, then high). `x = d * scale * q - dmin * min`.
fn dequant_q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..144];
    for (g, (q, y)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc_lo, m_lo) = q4_k_scale_min(2 * g, scales);
        let (sc_hi, m_hi) = q4_k_scale_min(2 * g + 1, scales);
        let (d_lo, m_lo) = (d * f32::from(sc_lo), dmin * f32::from(m_lo));
        let (d_hi, m_hi) = (d * f32::from(sc_hi), dmin * f32::from(m_hi));
        for (l, &q) in q.iter().enumerate() {
            y[l] = d_lo * f32::from(q & 0x0f) - m_lo;
            y[l + 32] = d_hi * f32::from(q >> 4) - m_hi;
        }
    }
}

/// Q5_K: 256 elements in 8 sub-blocks of 32. f16 `d` and `dmin` and 12 bytes of packed 6-bit
/// scales and minimums as in Q4_K, then 32 bytes of high bits (`qh`) and 128 bytes of
/// nibbles laid out as in Q4_K. Element `l` (0..32) of sub-block `j` takes its fifth bit from
/// bit `j` of `qh` byte `l`. `x = d * scale * q - dmin * min`, with 5-bit codes.
fn dequant_q5_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    for (j, y) in y.chunks_exact_mut(32).enumerate() {
        let (sc, m) = q4_k_scale_min(j, scales);
        let (dl, ml) = (d * f32::from(sc), dmin * f32::from(m));
        let q = &qs[(j / 2) * 32..][..32];
        let shift = 4 * (j % 2);
        for ((y, &q), &h) in y.iter_mut().zip(q).zip(qh) {
            let code = ((q >> shift) & 0x0f) | (((h >> j) & 1) << 4);
            *y = dl * f32::from(code) - ml;
        }
    }
}

/// Q6_K: 256 elements with 16 signed 8-bit scales (one per 16 elements) and an f16 `d`.
/// Codes are 6 bits: the low 4 in `ql` (128 bytes), the high 2 in `qh` (64 bytes). In each
/// half of 128 elements, `ql` byte `l` holds elements `l` (low nibble) and `l + 64` (high),
/// byte `l + 32` holds `l + 32` and `l + 96`, and `qh` byte `l` holds the top bits of
/// `l`, `l + 32`, `l + 64`, `l + 96` in bit pairs 0, 2, 4, 6. `x = d * scale * (q - 32)`.
fn dequant_q6_k(b: &[u8], y: &mut [f32]) {
    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = half_at(b, 208);
    for (h, y) in y.chunks_exact_mut(128).enumerate() {
        let (ql, qh, sc) = (&ql[h * 64..], &qh[h * 32..], &sc[h * 8..]);
        for l in 0..32 {
            let code =
                |low: u8, shift: u8| f32::from(i16::from(low | (((qh[l] >> shift) & 3) << 4)) - 32);
            let s = |k: usize| d * f32::from(sc[l / 16 + k] as i8);
            y[l] = s(0) * code(ql[l] & 0x0f, 0);
            y[l + 32] = s(2) * code(ql[l + 32] & 0x0f, 2);
            y[l + 64] = s(4) * code(ql[l] >> 4, 4);
            y[l + 96] = s(6) * code(ql[l + 32] >> 4, 6);
        }
    }
}

/// Q8_K: an f32 scale (not f16, unlike the other types), 256 signed bytes, then 16 i16 sums of
/// groups of 16 codes that ggml keeps for its dot products and dequantisation ignores;
/// `x = d * q`.
fn dequant_q8_k(b: &[u8], y: &mut [f32]) {
    let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for (y, &q) in y.iter_mut().zip(&b[4..260]) {
        *y = d * f32::from(q as i8);
    }
}

/// The 16 values a 4-bit code of IQ4_NL and IQ4_XS stands for: a fixed non-uniform grid, denser
/// near zero, scaled by the block's (or sub-block's) scale.
const IQ4_GRID: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// 32 values from 16 bytes of 4-bit grid indices under one scale: byte `j`'s low nibble is
/// value `j`, its high nibble value `j + 16`.
fn iq4_half_bytes(scale: f32, q: &[u8], y: &mut [f32]) {
    let (lo, hi) = y.split_at_mut(16);
    for ((&q, lo), hi) in q.iter().zip(lo).zip(hi) {
        *lo = scale * f32::from(IQ4_GRID[usize::from(q & 0x0f)]);
        *hi = scale * f32::from(IQ4_GRID[usize::from(q >> 4)]);
    }
}

/// IQ4_NL: an f16 scale and 16 bytes of 4-bit indices into [`IQ4_GRID`]; `x = d * grid[q]`.
fn dequant_iq4_nl(b: &[u8], y: &mut [f32]) {
    iq4_half_bytes(half_at(b, 0), &b[2..18], y);
}

/// IQ4_XS: 256 values in 8 sub-blocks of 32. An f16 `d`, then each sub-block's 6-bit scale
/// split into a high part (2 bits each of a u16, sub-block `i` at bits `2i`) and a low part (a
/// nibble each of 4 bytes, sub-block `i` in byte `i / 2`, low nibble first), stored plus 32;
/// then 128 bytes of grid indices as in IQ4_NL, 16 a sub-block. `x = (d * (scale - 32)) *
/// grid[q]`.
fn dequant_iq4_xs(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let high = u16::from_le_bytes([b[2], b[3]]);
    for (i, y) in y.chunks_exact_mut(32).enumerate() {
        let low = (b[4 + i / 2] >> (4 * (i % 2))) & 0x0f;
        let scale = i32::from(low | ((((high >> (2 * i)) & 3) as u8) << 4)) - 32;
        iq4_half_bytes(d * scale as f32, &b[8 + 16 * i..24 + 16 * i], y);
    }
}

/// Writes GGUF files (v3): the layout `GgufFile` reads. Used by the GGUF export and by tests.
pub(crate) mod writer {
    use super::GgufValue;

    #[derive(Clone)]
    pub(crate) struct Tensor {
        pub name: String,
        pub dims: Vec<u64>,
        pub ggml_type: u32,
        pub data: Vec<u8>,
    }

    /// A GGUF v3 file with `metadata` and `tensors`, data aligned to `general.alignment`
    /// (32 when the metadata does not set it).
    pub(crate) fn gguf_bytes(metadata: &[(&str, GgufValue)], tensors: &[Tensor]) -> Vec<u8> {
        let align = metadata
            .iter()
            .find(|(k, _)| *k == "general.alignment")
            .and_then(|(_, v)| v.as_u64())
            .unwrap_or(32) as usize;
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((tensors.len() as u64).to_le_bytes());
        out.extend((metadata.len() as u64).to_le_bytes());
        for (k, v) in metadata {
            string(&mut out, k);
            out.extend(type_id(v).to_le_bytes());
            value(&mut out, v);
        }
        let mut offset = 0u64;
        for t in tensors {
            string(&mut out, &t.name);
            out.extend((t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(t.ggml_type.to_le_bytes());
            out.extend(offset.to_le_bytes());
            offset = (offset + t.data.len() as u64).next_multiple_of(align as u64);
        }
        for t in tensors {
            out.resize(out.len().next_multiple_of(align), 0);
            out.extend(&t.data);
        }
        out
    }

    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }

    fn type_id(v: &GgufValue) -> u32 {
        match v {
            GgufValue::U8(_) => 0,
            GgufValue::I8(_) => 1,
            GgufValue::U16(_) => 2,
            GgufValue::I16(_) => 3,
            GgufValue::U32(_) => 4,
            GgufValue::I32(_) => 5,
            GgufValue::F32(_) => 6,
            GgufValue::Bool(_) => 7,
            GgufValue::String(_) => 8,
            GgufValue::Array(_) => 9,
            GgufValue::U64(_) => 10,
            GgufValue::I64(_) => 11,
            GgufValue::F64(_) => 12,
        }
    }

    fn value(out: &mut Vec<u8>, v: &GgufValue) {
        match v {
            GgufValue::U8(x) => out.push(*x),
            GgufValue::I8(x) => out.extend(x.to_le_bytes()),
            GgufValue::U16(x) => out.extend(x.to_le_bytes()),
            GgufValue::I16(x) => out.extend(x.to_le_bytes()),
            GgufValue::U32(x) => out.extend(x.to_le_bytes()),
            GgufValue::I32(x) => out.extend(x.to_le_bytes()),
            GgufValue::U64(x) => out.extend(x.to_le_bytes()),
            GgufValue::I64(x) => out.extend(x.to_le_bytes()),
            GgufValue::F32(x) => out.extend(x.to_le_bytes()),
            GgufValue::F64(x) => out.extend(x.to_le_bytes()),
            GgufValue::Bool(x) => out.push(u8::from(*x)),
            GgufValue::String(s) => string(out, s),
            GgufValue::Array(items) => {
                // An empty array's element type is not recoverable; any type reads back empty.
                let elem = items.first().map_or(5, type_id);
                out.extend(elem.to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                for item in items {
                    value(out, item);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::writer::{Tensor, gguf_bytes};
    use super::*;

    /// A deterministic pseudo-random stream (xorshift), so the tests need no RNG crate.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn uniform(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        }
        fn byte(&mut self) -> u8 {
            self.next() as u8
        }
    }

    fn f16_bytes(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_le_bytes()
    }

    fn f16_round(x: f32) -> f32 {
        f16::from_f32(x).to_f32()
    }

    /// Q8_0 reference quantiser: scale = max |x| / 127.
    fn quantize_q8_0(x: &[f32]) -> (Vec<u8>, Vec<f32>) {
        let (mut bytes, mut expect) = (vec![], vec![]);
        for block in x.chunks(32) {
            let amax = block.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            bytes.extend(f16_bytes(d));
            for &v in block {
                let q = if d == 0.0 { 0 } else { (v / d).round() as i8 };
                bytes.push(q as u8);
                expect.push(f16_round(d) * f32::from(q));
            }
        }
        (bytes, expect)
    }

    /// Q4_0 reference quantiser: the value of largest magnitude maps to code 0 (-8).
    fn quantize_q4_0(x: &[f32]) -> (Vec<u8>, Vec<f32>) {
        let (mut bytes, mut expect) = (vec![], vec![0f32; x.len()]);
        for (b, block) in x.chunks(32).enumerate() {
            let max = block
                .iter()
                .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
            let d = max / -8.0;
            bytes.extend(f16_bytes(d));
            let code = |v: f32| ((v / d + 8.5) as i32).clamp(0, 15) as u8;
            for i in 0..16 {
                let (lo, hi) = (code(block[i]), code(block[i + 16]));
                bytes.push(lo | (hi << 4));
                expect[b * 32 + i] = f16_round(d) * (f32::from(lo) - 8.0);
                expect[b * 32 + i + 16] = f16_round(d) * (f32::from(hi) - 8.0);
            }
        }
        (bytes, expect)
    }

    /// Q4_1 reference quantiser: codes span [min, max] in 15 steps.
    fn quantize_q4_1(x: &[f32]) -> (Vec<u8>, Vec<f32>) {
        let (mut bytes, mut expect) = (vec![], vec![0f32; x.len()]);
        for (b, block) in x.chunks(32).enumerate() {
            let min = block.iter().fold(f32::MAX, |a, &v| a.min(v));
            let max = block.iter().fold(f32::MIN, |a, &v| a.max(v));
            let d = (max - min) / 15.0;
            bytes.extend(f16_bytes(d));
            bytes.extend(f16_bytes(min));
            let code = |v: f32| (((v - min) / d).round() as i32).clamp(0, 15) as u8;
            for i in 0..16 {
                let (lo, hi) = (code(block[i]), code(block[i + 16]));
                bytes.push(lo | (hi << 4));
                expect[b * 32 + i] = f16_round(d) * f32::from(lo) + f16_round(min);
                expect[b * 32 + i + 16] = f16_round(d) * f32::from(hi) + f16_round(min);
            }
        }
        (bytes, expect)
    }

    /// One Q4_K block from random codes, scales and minimums, and the values it stands for
    /// written out sub-block by sub-block.
    fn random_q4_k(rng: &mut Rng) -> (Vec<u8>, Vec<f32>) {
        let (d, dmin) = (f16_round(0.01), f16_round(0.002));
        let sc: Vec<u8> = (0..8).map(|_| rng.byte() & 63).collect();
        let mn: Vec<u8> = (0..8).map(|_| rng.byte() & 63).collect();
        let codes: Vec<u8> = (0..256).map(|_| rng.byte() & 15).collect();
        let mut packed = [0u8; 12];
        for j in 0..4 {
            packed[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
            packed[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
            packed[j + 8] = (sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4);
        }
        let mut bytes = vec![];
        bytes.extend(f16_bytes(d));
        bytes.extend(f16_bytes(dmin));
        bytes.extend(packed);
        // Sub-blocks 2g and 2g+1 share 32 bytes: low nibbles, then high nibbles.
        for g in 0..4 {
            for l in 0..32 {
                bytes.push(codes[64 * g + l] | (codes[64 * g + 32 + l] << 4));
            }
        }
        let expect = (0..256)
            .map(|i| {
                let s = i / 32;
                d * f32::from(sc[s]) * f32::from(codes[i]) - dmin * f32::from(mn[s])
            })
            .collect();
        (bytes, expect)
    }

    /// One Q6_K block from random 6-bit codes and signed scales.
    fn random_q6_k(rng: &mut Rng) -> (Vec<u8>, Vec<f32>) {
        let d = f16_round(0.003);
        let scales: Vec<i8> = (0..16).map(|_| rng.byte() as i8).collect();
        let q: Vec<u8> = (0..256).map(|_| rng.byte() & 63).collect();
        let (mut ql, mut qh) = (vec![0u8; 128], vec![0u8; 64]);
        for h in 0..2 {
            let q = &q[h * 128..];
            for l in 0..32 {
                ql[h * 64 + l] = (q[l] & 15) | ((q[l + 64] & 15) << 4);
                ql[h * 64 + l + 32] = (q[l + 32] & 15) | ((q[l + 96] & 15) << 4);
                qh[h * 32 + l] = (q[l] >> 4)
                    | ((q[l + 32] >> 4) << 2)
                    | ((q[l + 64] >> 4) << 4)
                    | ((q[l + 96] >> 4) << 6);
            }
        }
        let mut bytes = ql;
        bytes.extend(qh);
        bytes.extend(scales.iter().map(|&s| s as u8));
        bytes.extend(f16_bytes(d));
        let expect = (0..256)
            .map(|i| d * f32::from(scales[i / 16]) * (f32::from(q[i]) - 32.0))
            .collect();
        (bytes, expect)
    }

    fn write(dir: &tempfile::TempDir, name: &str, bytes: &[u8]) -> PathBuf {
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    fn tensor(name: &str, dims: &[u64], ty: GgmlType, data: Vec<u8>) -> Tensor {
        Tensor {
            name: name.into(),
            dims: dims.to_vec(),
            ggml_type: ty.0,
            data,
        }
    }

    fn assert_close(got: &[f32], want: &[f32], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-6 * w.abs().max(1.0),
                "{what}[{i}]: {g} != {w}"
            );
        }
    }

    #[test]
    fn every_supported_type_dequantises_to_the_reference_values() {
        let mut rng = Rng(0x9e3779b97f4a7c15);
        // Rows of 64 (two Q*_0 blocks) and of 256 (one K block); three rows each.
        let x: Vec<f32> = (0..192).map(|_| rng.uniform()).collect();
        let f16s: Vec<f32> = x.iter().map(|&v| f16_round(v)).collect();
        let bf16s: Vec<f32> = x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
        let (q8, q8_want) = quantize_q8_0(&x);
        let (q40, q40_want) = quantize_q4_0(&x);
        let (q41, q41_want) = quantize_q4_1(&x);
        let (mut q4k, mut q4k_want, mut q6k, mut q6k_want) = (vec![], vec![], vec![], vec![]);
        for _ in 0..3 {
            let (b, w) = random_q4_k(&mut rng);
            q4k.extend(b);
            q4k_want.extend(w);
            let (b, w) = random_q6_k(&mut rng);
            q6k.extend(b);
            q6k_want.extend(w);
        }
        let small = [64, 3];
        let cases: Vec<(Tensor, Vec<f32>)> = vec![
            (
                tensor(
                    "f32",
                    &small,
                    GgmlType::F32,
                    x.iter().flat_map(|v| v.to_le_bytes()).collect(),
                ),
                x.clone(),
            ),
            (
                tensor(
                    "f16",
                    &small,
                    GgmlType::F16,
                    x.iter().flat_map(|&v| f16_bytes(v)).collect(),
                ),
                f16s,
            ),
            (
                tensor(
                    "bf16",
                    &small,
                    GgmlType::BF16,
                    x.iter()
                        .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
                        .collect(),
                ),
                bf16s,
            ),
            (tensor("q8_0", &small, GgmlType::Q8_0, q8), q8_want),
            (tensor("q4_0", &small, GgmlType::Q4_0, q40), q40_want),
            (tensor("q4_1", &small, GgmlType::Q4_1, q41), q41_want),
            (tensor("q4_k", &[256, 3], GgmlType::Q4_K, q4k), q4k_want),
            (tensor("q6_k", &[256, 3], GgmlType::Q6_K, q6k), q6k_want),
        ];
        let tensors: Vec<Tensor> = cases.iter().map(|(t, _)| t.clone()).collect();
        let dir = tempfile::tempdir().unwrap();
        let path = write(&dir, "all.gguf", &gguf_bytes(&[], &tensors));
        let g = GgufFile::open(&path).unwrap();
        assert_eq!(g.tensor_names().count(), cases.len());
        for (t, want) in &cases {
            let (shape, got) = g.tensor_f32(&t.name).unwrap();
            assert_eq!(shape, vec![3, t.dims[0] as usize], "{}", t.name);
            assert_eq!(
                g.tensor_info(&t.name).unwrap().type_name(),
                GgmlType(t.ggml_type).name()
            );
            assert_close(&got, want, &t.name);
        }
        // The reference quantisers themselves are sane: Q8_0 is within half a step of the input.
        let (_, q8) = g.tensor_f32("q8_0").unwrap();
        for (a, b) in q8.iter().zip(&x) {
            assert!((a - b).abs() < 0.005, "{a} vs {b}");
        }
    }

    /// `blocks` blocks of `ty`: bytes of the xorshift stream seeded with `seed`, then each
    /// block's scale fields set to fixed finite values (random bytes read as f16 could be NaN
    /// or infinite). bench/gguf_quants_reference.py builds the same bytes.
    fn random_blocks(ty: GgmlType, seed: u64, blocks: usize) -> Vec<u8> {
        fn put(block: &mut [u8], at: usize, v: u16) {
            block[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
        let (_, size) = ty.block_layout().unwrap();
        let mut rng = Rng(seed);
        let mut data: Vec<u8> = (0..blocks * size).map(|_| rng.byte()).collect();
        for (b, block) in data.chunks_exact_mut(size).enumerate() {
            let b16 = b as u16;
            // f16 bits: d from about 0.01 upwards, negative in odd blocks; dmin from about
            // 0.003; Q5_1's minimum from 0.25, negative in every third block. Q8_K's f32 `d`
            // is about 0.002 upwards, negative in odd blocks.
            let d = (0x2147 + 0x0111 * b16) | ((b16 % 2) << 15);
            let dmin = 0x1a3b + 0x0105 * b16;
            let m = (0x3400 + 0x0123 * b16) | (u16::from(b % 3 == 0) << 15);
            match ty {
                GgmlType::Q5_0 => put(block, 0, d),
                GgmlType::Q5_1 => {
                    put(block, 0, d);
                    put(block, 2, m);
                }
                GgmlType::Q2_K => {
                    put(block, 80, d);
                    put(block, 82, dmin);
                }
                GgmlType::Q3_K => put(block, 108, d),
                GgmlType::Q5_K => {
                    put(block, 0, d);
                    put(block, 2, dmin);
                }
                GgmlType::Q8_K => {
                    let d = (0x3b0f_5c29 + 0x0012_3457 * b as u32) | ((b as u32 % 2) << 31);
                    block[0..4].copy_from_slice(&d.to_le_bytes());
                }
                GgmlType::IQ4_NL | GgmlType::IQ4_XS => put(block, 0, d),
                _ => unreachable!("{ty}"),
            }
        }
        data
    }

    /// FNV-1a (64-bit) of the values' little-endian f32 bytes.
    fn fnv1a(values: &[f32]) -> u64 {
        values
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .fold(0xcbf2_9ce4_8422_2325, |h, byte| {
                (h ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
            })
    }

    /// Reads `blocks` blocks of [`random_blocks`] as one `ty` tensor of a GGUF file (a row per
    /// block) and compares them with the reference: the first block value by value, bit for
    /// bit, against `block0` (f32 bits in hex, 8 digits a value), and all of them by `hash`
    /// ([`fnv1a`]).
    fn check_against_reference(ty: GgmlType, seed: u64, blocks: usize, hash: u64, block0: &str) {
        let (elems, _) = ty.block_layout().unwrap();
        let t = tensor(
            "w",
            &[elems as u64, blocks as u64],
            ty,
            random_blocks(ty, seed, blocks),
        );
        let dir = tempfile::tempdir().unwrap();
        let path = write(&dir, "q.gguf", &gguf_bytes(&[], &[t]));
        let g = GgufFile::open(&path).unwrap();
        assert_eq!(g.tensor_info("w").unwrap().type_name(), ty.name());
        let (shape, got) = g.tensor_f32("w").unwrap();
        assert_eq!(shape, vec![blocks, elems], "{ty}");
        let want: Vec<u32> = block0
            .as_bytes()
            .chunks(8)
            .map(|h| u32::from_str_radix(std::str::from_utf8(h).unwrap(), 16).unwrap())
            .collect();
        assert_eq!(want.len(), elems, "{ty}: reference block length");
        for (i, (g, &w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.to_bits(),
                w,
                "{ty}[{i}]: {g} != {} (reference)",
                f32::from_bits(w)
            );
        }
        assert!(got.iter().all(|v| v.is_finite()), "{ty}");
        assert_eq!(fnv1a(&got), hash, "{ty}: hash of all {blocks} blocks");
    }

    // The expected values come from bench/gguf_quants_reference.py: llama.cpp's gguf-py
    // (`gguf.quants.dequantize`) for Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, IQ4_NL and IQ4_XS, and numpy
    // from ggml's block struct for Q8_K, which gguf-py does not dequantise. Both compute in f32
    // in ggml's order, as kiln does, so the values agree to the bit.

    #[test]
    fn q5_0_blocks_dequantise_as_gguf_py_does() {
        check_against_reference(GgmlType::Q5_0, 0x5005, 8, Q5_0_HASH, Q5_0_BLOCK0);
    }

    #[test]
    fn q5_1_blocks_dequantise_as_gguf_py_does() {
        check_against_reference(GgmlType::Q5_1, 0x5105, 8, Q5_1_HASH, Q5_1_BLOCK0);
    }

    #[test]
    fn q2_k_blocks_dequantise_as_gguf_py_does() {
        check_against_reference(GgmlType::Q2_K, 0x2002, 4, Q2_K_HASH, Q2_K_BLOCK0);
    }

    #[test]
    fn q3_k_blocks_dequantise_as_gguf_py_does() {
        check_against_reference(GgmlType::Q3_K, 0x3003, 4, Q3_K_HASH, Q3_K_BLOCK0);
    }

    #[test]
    fn q5_k_blocks_dequantise_as_gguf_py_does() {
        check_against_reference(GgmlType::Q5_K, 0x5005_5005, 4, Q5_K_HASH, Q5_K_BLOCK0);
    }

    #[test]
    fn q8_k_blocks_dequantise_as_ggml_defines() {
        check_against_reference(GgmlType::Q8_K, 0x8008, 4, Q8_K_HASH, Q8_K_BLOCK0);
    }

    #[test]
    fn iq4_nl_blocks_dequantise_as_gguf_py_does() {
        check_against_reference(GgmlType::IQ4_NL, 0x4a4a, 8, IQ4_NL_HASH, IQ4_NL_BLOCK0);
    }

    #[test]
    fn iq4_xs_blocks_dequantise_as_gguf_py_does() {
        check_against_reference(GgmlType::IQ4_XS, 0x4b4b, 4, IQ4_XS_HASH, IQ4_XS_BLOCK0);
    }

    #[test]
    fn metadata_of_every_type_reads_back() {
        use GgufValue::*;
        let md = vec![
            ("general.architecture", String("llama".into())),
            ("general.alignment", U32(64)),
            ("u8", U8(7)),
            ("i8", I8(-7)),
            ("u16", U16(700)),
            ("i16", I16(-700)),
            ("i32", I32(-70000)),
            ("u64", U64(1 << 40)),
            ("i64", I64(-(1 << 40))),
            ("f32", F32(1e5)),
            ("f64", F64(1e-5)),
            ("bool", Bool(true)),
            (
                "tokens",
                Array(vec![
                    String("a".into()),
                    String("<|im_start|>".into()),
                    String("é".into()),
                ]),
            ),
            ("types", Array(vec![I32(1), I32(3)])),
            ("scores", Array(vec![F32(-1.5), F32(0.0)])),
            ("nested", Array(vec![Array(vec![U8(1)]), Array(vec![])])),
        ];
        let t = tensor("w", &[32], GgmlType::Q8_0, vec![0; 34]);
        let dir = tempfile::tempdir().unwrap();
        let path = write(&dir, "md.gguf", &gguf_bytes(&md, &[t]));
        let g = GgufFile::open(&path).unwrap();
        assert_eq!(g.version(), 3);
        assert_eq!(g.alignment(), 64);
        assert_eq!(g.architecture(), Some("llama"));
        for (k, v) in &md {
            assert_eq!(g.get(k), Some(v), "{k}");
        }
        assert_eq!(g.get_u64("u8"), Some(7));
        assert_eq!(g.get_u64("i8"), None);
        assert_eq!(g.get_u64("u64"), Some(1 << 40));
        assert_eq!(g.get_f64("f32"), Some(1e5));
        assert_eq!(g.get_f64("i16"), Some(-700.0));
        assert_eq!(g.get_bool("bool"), Some(true));
        assert_eq!(
            g.get_str_array("tokens"),
            Some(vec!["a", "<|im_start|>", "é"])
        );
        assert_eq!(g.get_i64_array("types"), Some(vec![1, 3]));
        assert_eq!(g.get_f32_array("scores"), Some(vec![-1.5, 0.0]));
        assert_eq!(g.get_str_array("types"), None);
        let e = g.require_u64("llama.block_count").unwrap_err().to_string();
        assert!(
            e.contains("llama.block_count") && e.contains("missing"),
            "{e}"
        );
        let e = g.require_str("u8").unwrap_err().to_string();
        assert!(e.contains("is a uint8"), "{e}");
        // The tensor sits at the 64-byte alignment the metadata asks for.
        assert_eq!(g.tensor_f32("w").unwrap().1, vec![0.0; 32]);
    }

    #[test]
    fn truncated_files_are_errors_naming_what_is_cut_off() {
        let t = tensor("blk.0.attn_q.weight", &[32, 2], GgmlType::Q8_0, vec![1; 68]);
        let md = [("general.name", GgufValue::String("x".into()))];
        let bytes = gguf_bytes(&md, &[t]);
        let dir = tempfile::tempdir().unwrap();
        // Cut in the data, in the tensor directory, in the metadata, in the magic.
        for (cut, what) in [
            (bytes.len() - 1, "the data of tensor blk.0.attn_q.weight"),
            (60, "tensor"),
            (30, "metadata"),
            (2, "magic"),
            (0, "magic"),
        ] {
            let path = write(&dir, "cut.gguf", &bytes[..cut]);
            let e = GgufFile::open(&path).unwrap_err();
            assert!(matches!(e, ImportError::Truncated { .. }), "cut {cut}: {e}");
            let msg = e.to_string();
            assert!(
                msg.contains("truncated") && msg.contains(what),
                "cut {cut}: {msg}"
            );
        }
        // Every other cut is an error too, never a panic.
        for cut in 0..bytes.len() {
            let path = write(&dir, "cut.gguf", &bytes[..cut]);
            assert!(GgufFile::open(&path).is_err(), "cut {cut}");
        }
    }

    #[test]
    fn unsupported_types_bad_magic_and_missing_tensors_are_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        // Q8_1 has a known block layout (its bytes can be read) but is not dequantised;
        // IQ2_XS has neither.
        let q81 = tensor("blk.0.ffn_down.weight", &[32], GgmlType(9), vec![0; 36]);
        let iq2 = tensor("blk.0.ffn_up.weight", &[256], GgmlType(17), vec![0; 74]);
        let odd = tensor("odd", &[4], GgmlType(99), vec![0; 4]);
        let path = write(&dir, "t.gguf", &gguf_bytes(&[], &[q81, iq2, odd]));
        let g = GgufFile::open(&path).unwrap();
        let e = g
            .tensor_f32("blk.0.ffn_down.weight")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("blk.0.ffn_down.weight") && e.contains("Q8_1"),
            "{e}"
        );
        assert_eq!(g.tensor_data("blk.0.ffn_down.weight").unwrap().len(), 36);
        let e = g.tensor_f32("blk.0.ffn_up.weight").unwrap_err().to_string();
        assert!(
            e.contains("blk.0.ffn_up.weight") && e.contains("IQ2_XS"),
            "{e}"
        );
        let e = g.tensor_f32("odd").unwrap_err().to_string();
        assert!(e.contains("odd") && e.contains("type 99"), "{e}");
        let e = g.tensor_f32("output.weight").unwrap_err().to_string();
        assert!(
            e.contains("output.weight") && e.contains("blk.0.ffn_down.weight"),
            "{e}"
        );

        let path = write(&dir, "st.safetensors", b"{\"__metadata__\":{}}");
        let e = GgufFile::open(&path).unwrap_err().to_string();
        assert!(e.contains("not a GGUF file"), "{e}");
        let mut v1 = gguf_bytes(&[], &[]);
        v1[4] = 1;
        let path = write(&dir, "v1.gguf", &v1);
        let e = GgufFile::open(&path).unwrap_err().to_string();
        assert!(e.contains("version 1"), "{e}");
        let e = GgufFile::open(&dir.path().join("nope.gguf"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("nope.gguf") && e.contains("cannot read"), "{e}");
    }

    // Printed by bench/gguf_quants_reference.py (see check_against_reference's tests).
    // Q5_0: 8 blocks, seed 0x5005
    const Q5_0_HASH: u64 = 0x26847aa3ea717c65;
    const Q5_0_BLOCK0: &str = "\
        bd93c400be13c4003da8e0003dbdfc00bd93c4003de834003d28e0003d7d50003c28e0003e093600bde83400\
        bdfd5000bc28e0003c28e0003da8e0003e093600bd93c40000000000bd7d5000bdd31800bdbdfc00bc28e000\
        3cfd5000bd28e000bdfd5000bde83400bca8e000bcfd50003d93c4003da8e0003e1e52003cfd5000\
    ";
    // Q5_1: 8 blocks, seed 0x5105
    const Q5_1_HASH: u64 = 0x9f096874fe7e1c90;
    const Q5_1_BLOCK0: &str = "\
        be605600bdd87800be40ac00be361e00bded9400be757200bdd87800bdc35c00bdc35c00be361e00be55c800\
        be2b9000bd992400be757200bd33a000bcbe60003d729000bc53e0003d8e6400bdae4000be40ac00be210200\
        be2b9000be55c800bd33a000bb2c0000bdae40003c936000bd9924003ce7d000be6ae400be361e00\
    ";
    // Q2_K: 4 blocks, seed 0x2002
    const Q2_K_HASH: u64 = 0xcefbf525b9071852;
    const Q2_K_BLOCK0: &str = "\
        bd158800bd1588003b9ac0003b9ac000bd1588003b9ac0003ccf9000bd158800bc823000bc8230003ccf9000\
        3b9ac0003b9ac000bd158800bd1588003ccf90003bd7c0003d19a0003d19a0003d8c24003d19a0003d8c2400\
        3d19a0003bd7c0003d8c24003d8c24003d8c24003d19a0003d19a000bcc760003bd7c0003bd7c0003d3f0200\
        3cd52400bc7938003cd524003cd524003bb11000bc7938003bb110003bb11000bc7938003cd524003d3f0200\
        3bb110003cd52400bc7938003d3f0200bc4760003d4b78003e3186003d4b7800bc4760003d4b78003e318600\
        bc4760003d4b78003e3186003e3186003d4b78003d4b7800bc476000bc4760003d4b78003e0f4180bd3aea00\
        3d9fdb00bd3aea00bd3aea003e0f41803e0f41803c84cc003d9fdb003d9fdb003d9fdb003d9fdb00bd3aea00\
        3c84cc003d9fdb003e0f4180bbc760003d3a2c003d3a2c003dc6a2003dc6a2003e181700bbc76000bbc76000\
        3d3a2c003dc6a200bbc76000bbc760003dc6a2003e181700bbc760003e181700bd2e7400bc3f3000bc3f3000\
        bd2e7400bc3f30003c9db8003d4d84003c9db800bc3f3000bd2e74003c9db800bc3f3000bc3f3000bd2e7400\
        3d4d8400bc3f30003e57ee00bd1588003e57ee003e037e003e57ee003e57ee003e57ee00bd158800bd158800\
        3d3c38003e57ee00bd158800bd1588003e57ee00bd1588003d3c38003ee105003ee10500bcc760003ee10500\
        3ee105003ee105003e0566003e91dc00bcc760003e0566003e0566003e0566003e91dc003e056600bcc76000\
        bcc76000bc958800bc958800bc9588003e8a6b803e0113003ed44d803ed44d803e8a6b803e0113003e8a6b80\
        bc9588003e0113003e8a6b80bc958800bc9588003e0113003e73f7803e1f87803e73f780bc1588003e73f780\
        3e1f87803e1f87803d962f003e73f7803e73f7803e73f7803e73f7803d962f00bc1588003d962f003e1f8780\
        3d837e003d837e003d837e00bc9588003d837e00bc9588003d837e003d837e00bc9588003e6a9f003d837e00\
        3e6a9f00bc9588003e162f00bc9588003d837e003dccdd003dccdd00bb4760003e4ffa803e9cc3403dccdd00\
        3e9cc3403e4ffa803e4ffa803e4ffa803e9cc3403dccdd003e4ffa80bb4760003e9cc3403e9cc3403e30d380\
        bd0912003d8e8f00bd0912003e8d2fc0bd091200bd0912003e8d2fc03e8d2fc03d8e8f003e30d3803e30d380\
        3d8e8f003d8e8f00bd0912003e30d380bbc760003e8618803e861880bbc76000bbc760003e02fb003ecab380\
        3e02fb003ecab3803e02fb00bbc760003ecab3803e8618803e861880bbc76000bbc76000bce04c003db02100\
        3db021003e4c2a80bce04c00bce04c003e4c2a803ea022403e4c2a803db021003ea022403ea022403db02100\
        3db021003ea02240bce04c00\
    ";
    // Q3_K: 4 blocks, seed 0x3003
    const Q3_K_HASH: u64 = 0x078cc014b3e610e6;
    const Q3_K_BLOCK0: &str = "\
        be3dfc003dbdfc0080000000be8e7d00be8e7d00bdbdfc003e8e7d00be3dfc0080000000bdbdfc003e8e7d00\
        3ebdfc003dbdfc003e3dfc00bdbdfc003e8e7d003ec88a003e488a003f488a003e488a003ec88a00be488a00\
        800000003ec88a003e488a00bf166780be488a003e488a003f488a00bf166780bf166780800000003e336e00\
        3e336e003eb36e00be336e00bf06928000000000bf336e00beb36e00beb36e00beb36e003f0692803e336e00\
        3eb36e003f06928000000000bf069280bd28e000bca8e000bc28e0003ca8e000bd28e000bd28e000bc28e000\
        3cfd5000bcfd50003c28e0003cfd5000000000003ca8e0003c28e000bcfd50003cfd5000be7d5000bebdfc00\
        be7d5000befd5000bdfd500000000000be7d50003dfd5000befd500000000000befd5000befd500000000000\
        3dfd5000bebdfc00bebdfc008000000000000000800000000000000000000000800000000000000080000000\
        8000000000000000000000000000000000000000800000000000000080000000bca8e000bca8e0003d28e000\
        bda8e00000000000bda8e000bca8e00000000000bca8e000bda8e000bd28e0003d28e000bca8e0003d7d5000\
        3ca8e000bca8e000bf659080bf6590803e990b00bf6590803f190b003e990b0080000000bf65908080000000\
        3f6590803f659080bf659080bf65908080000000bf6590803e990b003edda6003e93c400800000003edda600\
        80000000bedda60080000000bedda6003edda600bedda6003f13c400bedda600bedda6003edda6003e93c400\
        3e93c400be8936003e0936003e8936003e8936003e093600be093600be893600becdd1003e893600becdd100\
        3e093600800000003ecdd10080000000becdd100800000003e72c200bf72c200bf72c200000000003ef2c200\
        3f3611803f361180be72c20000000000be72c200bf72c2003f36118000000000be72c200be72c2003f361180\
        bf8936003e8936003f4dd10000000000bf093600be893600bf0936003e8936003e893600bf4dd100bf093600\
        be893600bf4dd1003f093600bf4dd100bf4dd100bedda600000000003e5da6003e5da600bedda600bedda600\
        bf263c80bf5da6000000000000000000bedda6003e5da600bf5da600be5da600bf263c80be5da6003e1e5200\
        00000000bd531800000000003e1e5200bdd318003e1e5200000000003e1e52003dd31800bd531800bd531800\
        3e1e5200bdd31800be531800be5318003f0e7d0000000000be8e7d00be8e7d00be8e7d003f55bb803f55bb80\
        bf55bb80bf55bb803f55bb80bf0e7d00bf8e7d00bf8e7d003f55bb8000000000bf55bb80be683400bee83400\
        bf2e2700be68340000000000bee834003f2e2700be6834003f2e2700bf6834003ee83400be6834003ee83400\
        be683400be6834003f2e2700\
    ";
    // Q5_K: 4 blocks, seed 0x50055005
    const Q5_K_HASH: u64 = 0xb6ed446512de0331;
    const Q5_K_BLOCK0: &str = "\
        41334f8040cc42403ffb0a4040f2d9703fc79600404ab380411995603f415b0041334f803ffb0a404098ce00\
        40d91f50411326d8407e27c0407e27c04126727040646da0412003e840d91f5041267270412672704139be08\
        40d91f5041199560404ab380407e27c0408bf0f041469b18408bf0f041469b1841267270411995604047d008\
        4137893241126dfa40cbcdd43fa22510410b02223fdd83d04128b182415ca46a40ae1e7440cbcdd441126dfa\
        40ae1e743fa22510bdff730041301d5a40e97d343f4d8ca0414dccba4128b182408197644119d9d240bcf624\
        4128b18240e97d34413ef50a4047d0084103964a40f854e440819764bdff73003f4d8ca04128edc4413e33fc\
        4008c430410578bc408b4c28415a919c4008c43040e06508415a919c410c9024415a919c3fd8cd20408b4c28\
        410c90243f4ead403f4ead40407a3ab04130052c40c40768407a3ab0402521d040e065084008c43040e06508\
        414c62cc410c902440b5d8984121d65c4121d65c41537a34408b4c28414c62cc4083e0e03fe0110041248f40\
        406969804142e7803f4d600040b1654040930d0040a239204159a9b041613fc040ee15c0411cf930410dcd10\
        3ea7fe004159a9b0410dcd104133bb6040930d004083e0e041156320413b51704159a9b041613fc04083e0e0\
        40696980410dcd103f4d600040930d00be1588004142e7803ea7fe00408204c04027af004086a2e0404363c0\
        3ee93a00401e72c03f198e003ee93a004002be003ff303803fe08b003fe08b00404ca0003ee93a003f96a900\
        4086a2e03f3e7f003e9f58003fbb9a00bdf938003fe08b003fbb9a00403a2780401e72c03cb94000401e72c0\
        404ca000404ca0004055dc404055dc404030eb40408204c03d764000bd2ff0003cef3000bdc18400be0afa00\
        bd2ff0003de4ac00bd05b8003e31aa003e1c8e00bdd6a0003dba7400bd2ff000bae200003e271c003dba7400\
        bd05b8003c9ac000bd5a28003de4ac003d903c00bd974c00bc452000bd2ff000bcb70000bd05b800be158800\
        3e31aa00bd974c00bd974c00bc452000bd974c0040e03cdc41825ac3415043f6406eb37840abcb4c4147865e\
        409a501c4186b98f4028c6b8412d4d964186b98f40cec1ac4028c6b841733a564088d4ec41360b2e4159018e\
        4101999e406eb3784101999e41248ffe411bd26641733a5641360b2e41248ffe40f1b80c40cec1ac41825ac3\
        41248ffe412d4d96406eb37840cec1ac40919a2440e0c32440fe72844117f612407b9fc8409b7f4440af4984\
        40e0c32440fe72844087b5044117f612407b9fc8410e10f23fe230104117f61240a5646440af49843e624c80\
        3fe230104004e24840540b48bdb4af004087b50440e0c32440540b483fe2301040af498440f48d6441130382\
        4067d5884018ac8841042bd2\
    ";
    // Q8_K: 4 blocks, seed 0x8008
    const Q8_K_HASH: u64 = 0xd88959497f13d609;
    const Q8_K_BLOCK0: &str = "\
        3e49999abde8f5c3bbd70a3ebd2147aebe8e3d71be49999abe16147bbde000003e3570a4bce8f5c3bdbc28f6\
        3e2c7ae13d1851ecbd4e147bbd451eb8bd71eb85be528f5cbe66b8523b8f5c29be5b851f3e8e3d713e3e6666\
        3e11999a3dff5c29bd3c28f63e8428f6bdc51eb83e1f0a3dbe42e148be40a3d7bdf666663dd70a3ebc8f5c29\
        3e8e3d713e11999abd2a3d71bdf1eb853e5051ecbe6fae153e4e147b3e68f5c33e71eb853db33333bdce147b\
        bc333333be7ae1483e6b33333e0428f6bd1851ec3e01eb85bd68f5c33d6000003daeb852be30f5c33df1eb85\
        bdb33333bd3c28f63e0ae148be2eb8523e78a3d7be8e3d713e5b851f3e71eb85be8d1eb83dc9999a3dff5c29\
        3d600000be54cccd3e37ae15bc8f5c29be475c29be0ae148be7d1eb83dfae148be25c28f3df66666bc333333\
        bd570a3ebd81eb853e6000003e0666663d68f5c33dbc28f6bd9851ecbb0f5c29bdc51eb83e5947aebb0f5c29\
        3dce147b3d0f5c293e25c28f3e8d1eb83d570a3e3e570a3e3d451eb83e40a3d73e5b851fbe7f5c293e3570a4\
        bcc51eb83e866666be71eb85be54cccd3e8428f63df1eb853e25c28fbe570a3e3e6fae153e7d1eb8be5dc28f\
        be1ccccd3e2800003e30f5c33e23851f3e11999abe2800003d2147ae3d68f5c33d8666663dc51eb8bc0f5c29\
        be623d71bda147ae3e08a3d73e6fae15bdc9999abe81eb853e6b33333dc9999abe8547aebd8f5c29be66b852\
        be13d70abcc51eb8bdaa3d71be7d1eb8bdbc28f63d2a3d713c3333333e7d1eb83e11999abe7428f6bdfae148\
        3e623d71be6b33333d451eb83e1851ecbe8ae1483e11999a3e80cccdbe1f0a3dbe0666663ce8f5c33e5dc28f\
        3db7ae153d3c28f63e475c293b0f5c293e80cccd3e830a3dbe30f5c33dbc28f63e7f5c29be37ae153d71eb85\
        3d4e147b3e6fae153e87851fbe8547aebd7ae148be3570a43c0f5c29be0f5c29bdaeb852be01eb853c7ae148\
        be1a8f5cbe13d70abe2800003e71eb853dfae1483c0f5c29be7f5c29be1f0a3d3e066666be13d70a3d71eb85\
        3ddb851f3e475c29be6b33333e2eb852bc0f5c29bbd70a3ebe6000003e54cccd3dd28f5cbd81eb85bdc51eb8\
        3d0666663d4e147bbe5051ecbdbc28f63e2c7ae13e5947aebe30f5c3be6000003d0666663e54cccd3e2c7ae1\
        3e66b852bd3c28f63db333333e066666bdaa3d713e89c28fbd3c28f63e68f5c33e528f5cbdd70a3e3e280000\
        be80cccdbcfae1483e7428f6be6b33333e81eb85be37ae15be16147b3cb333333e4e147bbc8f5c293d600000\
        be475c293e766666be570a3e3e39eb85bdb7ae153e3333333e4e147b3e0666663e8428f63e7f5c29be8428f6\
        3e5947ae3d066666be7428f6bdc51eb8bc7ae148be528f5cbd81eb85be528f5c3d600000bd71eb853dbc28f6\
        3e0f5c293e68f5c3bc0f5c29\
    ";
    // IQ4_NL: 8 blocks, seed 0x4a4a
    const IQ4_NL_HASH: u64 = 0x9cd0ff6907fd37b8;
    const IQ4_NL_BLOCK0: &str = "\
        3f9515c03f9515c0bf014b803f6ad780beb8b5003f6ad7803e83ef003f0bd9803f361180be6834003e093600\
        3c28e000bfa78e403f3611803ec88a003f9515c0be6834003f0bd980be6834003ec88a003f0bd980be683400\
        bf5b02803f3611803e0936003f6ad7803c28e000be6834003f0bd980bf893600bf5b02803ec88a00\
    ";
    // IQ4_XS: 4 blocks, seed 0x4b4b
    const IQ4_XS_HASH: u64 = 0xfdfef613875e04bc;
    const IQ4_XS_BLOCK0: &str = "\
        c1d4d34c4127640840d26f20419b6f2c40d26f20c17d7a38c135bd10416a58d8416a58d8c1a4ffdcc0ef2130\
        c2071bb6c078b1e0c17d7a38416a58d840d26f20c078b1e0c1d4d34cc2071bb6c078b1e0419b6f2cc078b1e0\
        c1d4d34c403f4dc0c0ef2130c1a4ffdcc17d7a3841276408be990b004217d8ea403f4dc0c135bd10c0966780\
        408a87c0412441e0408a87c0c045e680408a87c0bdfd5000414dd100c0d1c6404100a2a0c0d1c6404100a2a0\
        414dd100bfcdd100c1088d20c0d1c640402e2700c1088d20bfcdd100bfcdd100bfcdd100c15fa0a0c0966780\
        c045e680c1088d20bfcdd100c1088d20402e270040c1f1404100a2a0bdfd5000402e27003f014b803f014b80\
        be0936003f014b803f5b0280bf0bd980bf9515c0be093600bf6ad7803e683400bf9515c03dd31800bec88a00\
        bf9515c03f2b83803f2b83803f893600bf6ad780bf0bd9803e6834003eb8b500be0936003f2b8380bf361180\
        3e683400bc28e0003dd318003f2b83803f8936003f2b83803e683400bec88a00bfe6e240c074bca03fcb2d80\
        40f01e8040624420bd93c40041129c783f38b500bf701e8041129c7840219e6040f01e80c074bca0bd93c400\
        41129c78c02f78c03f38b50040f01e80c0cd7c90bfe6e24040bfa23040961310c0cd7c9040624420bd93c400\
        c09f4f5040961310c09f4f504096131040961310bd93c400bd93c400bee834003e893600c00936003ca8e000\
        3f488a00bfdb02803f8bd9803fead780c0093600bf38b5003f488a00bf38b5003e8936003ca8e000c0278e40\
        401515c0401515c0bee834003f488a003e8936003f8bd980c0278e40bee834003f8bd980bfdb0280c0093600\
        bfdb0280bf38b5003f488a00bee83400401515c0c0278e40bfab8380bfdb02803fb61180401515c03ca8e000\
        bee834003f8bd980c0278e403fead7803f03ef003f8bd9803e893600bee83400c0278e40bfdb02803e893600\
        3fead7803f03ef00bee834003fead780c0093600bfdb0280bee83400bee83400bfab8380be5318003ca8e000\
        3fead780c0278e40be5318003e8936003f488a0040f4bca040af78c0411f4f50c116131040af78c0c0e24420\
        3ff01e80c0e24420c1929c78c1701e80c1929c78c1701e80c1929c7840f4bca041827308c1701e80411f4f50\
        c1929c78c1701e80c1701e8040f4bca040f4bca040f4bca0c13fa230418273083ff01e804066e24040f4bca0\
        c1929c7841827308c13fa230c04b2d80406395e0406395e0bfe6e2403f2b83803d5318003fa4eac03fa4eac0\
        c0566460c088e1903ffaac80c0d171d0406395e0c0ab8380c0219e60402ecfe0402ecfe0c0ab8380c0566460\
        c0d171d03d531800c0ab8380c0ab83804092c6b03f2b83803d53180040ba5b30402ecfe0bf912080406395e0\
        c088e190c0d171d0c0ab8380\
    ";
}
