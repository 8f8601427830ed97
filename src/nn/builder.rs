//! Naming and filling parameters while a model is built.
//!
//! A [`ParamBuilder`] carries the name of the layer being built, as nested scopes
//! (`blocks.3` > `attn` > `qkv`), so a layer names its parameters by their last part
//! (`weight`) and the full name (`blocks.3.attn.qkv.weight`) follows from where it sits. It
//! fills each parameter either from its initialisation, drawing from the model's RNG in the
//! order the layers ask (so a model built through it is the model built before, draw for
//! draw), or from a [`WeightSource`]: tensors read from a file, found under a [`NameMap`] of
//! the parameters' names, each taken once, every one of them used.

use super::{Init, Param};
use crate::engine::rng::Rng;
use crate::engine::{DType, EngineError, MemoryPool, Result};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Display;
use std::sync::Arc;

/// A host tensor read from a weight file: row-major shape and f32 values.
#[derive(Debug, Clone)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// How a parameter's name in kiln becomes the name of its tensor in a weight source.
pub struct NameMap(Box<dyn Fn(&str) -> String + Send + Sync>);

impl NameMap {
    /// The same name (a file kiln wrote: a checkpoint's `model.safetensors`).
    pub fn identity() -> NameMap {
        NameMap(Box::new(str::to_string))
    }

    /// The name behind `prefix` (`model.` + `layers.0.ln1.weight`).
    pub fn prefix(prefix: &str) -> NameMap {
        let prefix = prefix.to_string();
        NameMap(Box::new(move |name| format!("{prefix}{name}")))
    }

    /// Any other mapping.
    pub fn new(map: impl Fn(&str) -> String + Send + Sync + 'static) -> NameMap {
        NameMap(Box::new(map))
    }

    pub fn apply(&self, name: &str) -> String {
        (self.0)(name)
    }
}

/// Tensors to build parameters from, by their names in the source. It borrows them, so one
/// set of imported weights can build several models (a data-parallel rank each), and copies
/// each out as its parameter is made.
pub struct WeightSource<'w> {
    /// Where the tensors came from (a path), for errors.
    origin: String,
    tensors: &'w BTreeMap<String, HostTensor>,
    /// The names taken so far: each tensor is taken once.
    taken: BTreeSet<String>,
    map: NameMap,
    /// Parameters whose tensors stay here, checked and counted as taken but not copied into
    /// the pool: the caller reads them from the map later (a base quantised to NF4 straight
    /// from the host, never held dense on the device).
    defer: Option<fn(&str) -> bool>,
}

impl<'w> WeightSource<'w> {
    pub fn new(
        origin: impl Display,
        tensors: &'w BTreeMap<String, HostTensor>,
        map: NameMap,
    ) -> WeightSource<'w> {
        WeightSource {
            origin: origin.to_string(),
            tensors,
            taken: BTreeSet::new(),
            map,
            defer: None,
        }
    }

    /// The same source leaving the parameters `defer` names (kiln's names) on the host: each
    /// is built as an empty, frozen placeholder (see [`WeightSource::defer`]).
    pub fn deferring(mut self, defer: fn(&str) -> bool) -> Self {
        self.defer = Some(defer);
        self
    }

    fn error(&self, detail: String) -> EngineError {
        EngineError::Weights {
            origin: self.origin.clone(),
            detail,
        }
    }

    /// The values of parameter `name`, which must have `shape`.
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        Ok(self.take_ref(name, shape)?.data.clone())
    }

    /// The tensor of parameter `name`, checked against `shape` and counted as taken.
    fn take_ref(&mut self, name: &str, shape: &[usize]) -> Result<&'w HostTensor> {
        let key = self.map.apply(name);
        let t = match self.tensors.get(&key) {
            Some(t) if !self.taken.contains(&key) => t,
            Some(_) => {
                return Err(self.error(format!(
                    "tensor {key} would fill two parameters ({name} is the second); the name mapping is wrong"
                )));
            }
            None => {
                return Err(self.error(format!(
                    "has no tensor {key} for the model's parameter {name}"
                )));
            }
        };
        if t.shape != shape {
            return Err(self.error(format!(
                "tensor {key} has shape {:?}, the model's parameter {name} {shape:?}",
                t.shape
            )));
        }
        self.taken.insert(key);
        Ok(t)
    }

    /// Ends the build: a tensor no parameter took is an error, so that a mapping mistake
    /// cannot pass silently.
    pub fn finish(self) -> Result<()> {
        let extra: Vec<&String> = self
            .tensors
            .keys()
            .filter(|k| !self.taken.contains(*k))
            .collect();
        if extra.is_empty() {
            return Ok(());
        }
        Err(self.error(format!(
            "has {} tensors the model does not use: {:?}",
            extra.len(),
            &extra[..extra.len().min(3)]
        )))
    }
}

/// Where new parameters get their values.
enum Fill<'a, 'w> {
    Init(&'a mut Rng),
    Load(&'a mut WeightSource<'w>),
}

/// Names parameters by nested scopes and initialises or loads them (see the module comment).
pub struct ParamBuilder<'a, 'w> {
    pool: &'a Arc<MemoryPool>,
    prefix: String,
    fill: Fill<'a, 'w>,
    /// Parameters are made frozen (no gradient buffer): a model to run, not to train.
    frozen: bool,
    /// With `frozen`: the dtype every matrix is held in from the moment it is made.
    held_in: Option<DType>,
}

impl<'a, 'w> ParamBuilder<'a, 'w> {
    /// Parameters in `pool` initialised from `rng`.
    pub fn init(pool: &'a Arc<MemoryPool>, rng: &'a mut Rng) -> ParamBuilder<'a, 'w> {
        ParamBuilder {
            pool,
            prefix: String::new(),
            fill: Fill::Init(rng),
            frozen: false,
            held_in: None,
        }
    }

    /// Parameters in `pool` holding the tensors of `source`.
    pub fn load(
        pool: &'a Arc<MemoryPool>,
        source: &'a mut WeightSource<'w>,
    ) -> ParamBuilder<'a, 'w> {
        ParamBuilder {
            pool,
            prefix: String::new(),
            fill: Fill::Load(source),
            frozen: false,
            held_in: None,
        }
    }

    /// The same builder making every parameter frozen from the start: no gradient buffer
    /// is ever allocated, so a model built to run (generation) peaks at its values alone.
    pub fn frozen(mut self) -> Self {
        self.frozen = true;
        self
    }

    /// [`Self::frozen`], with every matrix (two or more dimensions) converted to `dtype` as
    /// soon as it is made (`None`: kept in f32), so that a model built to run in bf16 never
    /// holds more than one matrix in f32: its peak while loading is its bf16 values and the
    /// largest matrix in f32, where converting afterwards would peak at every value in f32.
    /// Vectors stay f32 until [`Param::set_compute_dtype`]: the parameters a layer reads as
    /// f32 masters (the BK-Core's) are vectors.
    pub fn frozen_in(mut self, dtype: Option<DType>) -> Self {
        self.frozen = true;
        self.held_in = dtype;
        self
    }

    /// `p` as [`Self::frozen_in`] holds it.
    fn held(&self, mut p: Param) -> Result<Param> {
        if let Some(d) = self.held_in
            && p.value.shape().len() >= 2
            && p.value.dtype() != d
        {
            p.value = p.value.converted(self.pool, d)?;
        }
        Ok(p)
    }

    pub fn pool(&self) -> &'a Arc<MemoryPool> {
        self.pool
    }

    /// The name of the scope (empty at the top).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The full name of `part` in this scope.
    pub fn name(&self, part: &str) -> String {
        if self.prefix.is_empty() {
            part.to_string()
        } else {
            format!("{}.{part}", self.prefix)
        }
    }

    /// A builder for the parts of `name` in this scope; it fills from the same RNG or source.
    pub fn scope(&mut self, name: impl Display) -> ParamBuilder<'_, 'w> {
        ParamBuilder {
            pool: self.pool,
            prefix: self.name(&name.to_string()),
            fill: match &mut self.fill {
                Fill::Init(rng) => Fill::Init(rng),
                Fill::Load(source) => Fill::Load(source),
            },
            frozen: self.frozen,
            held_in: self.held_in,
        }
    }

    /// Parameter `part` of this scope, of `shape`, initialised by `init` or loaded.
    pub fn param(&mut self, part: &str, shape: &[usize], init: Init) -> Result<Param> {
        let name = self.name(part);
        let p = match &mut self.fill {
            Fill::Init(rng) => Param::initialised(self.pool, name, shape, init, rng, self.frozen),
            Fill::Load(source) if source.defer.is_some_and(|d| d(&name)) => {
                source.take_ref(&name, shape)?;
                return Param::holding(self.pool, name, &[0], Vec::new(), true);
            }
            Fill::Load(source) => {
                let values = source.take(&name, shape)?;
                Param::holding(self.pool, name, shape, values, self.frozen)
            }
        }?;
        self.held(p)
    }

    /// Parameter `part` starting from `values` (or loaded).
    pub fn param_from(&mut self, part: &str, shape: &[usize], values: Vec<f32>) -> Result<Param> {
        let name = self.name(part);
        let values = match &mut self.fill {
            Fill::Init(_) => values,
            Fill::Load(source) => source.take(&name, shape)?,
        };
        let p = Param::holding(self.pool, name, shape, values, self.frozen)?;
        self.held(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Device;
    use crate::engine::rng::stream;

    /// Scopes nest into names; a builder draws what `Param::initialised` draws, in order; loading
    /// takes tensors by mapped name and shape and refuses what is missing, misshapen or left.
    #[test]
    fn scopes_name_and_sources_fill() {
        let pool = MemoryPool::new(Device::Cpu);
        let mut rng = Rng::new(4, stream::INIT);
        let mut b = ParamBuilder::init(&pool, &mut rng);
        let w = b
            .scope("blocks.1")
            .scope("attn")
            .param("weight", &[2, 3], Init::Normal(1.0))
            .unwrap();
        let g = b
            .scope("ln_f")
            .param("weight", &[3], Init::Uniform(1.0))
            .unwrap();
        assert_eq!(
            (w.name.as_str(), g.name.as_str()),
            ("blocks.1.attn.weight", "ln_f.weight")
        );
        let mut direct = Rng::new(4, stream::INIT);
        let w0 = Param::initialised(
            &pool,
            "w".into(),
            &[2, 3],
            Init::Normal(1.0),
            &mut direct,
            false,
        )
        .unwrap();
        let g0 = Param::initialised(
            &pool,
            "g".into(),
            &[3],
            Init::Uniform(1.0),
            &mut direct,
            false,
        )
        .unwrap();
        assert_eq!(w.value.to_vec().unwrap(), w0.value.to_vec().unwrap());
        assert_eq!(g.value.to_vec().unwrap(), g0.value.to_vec().unwrap());

        let tensor = |shape: &[usize]| HostTensor {
            shape: shape.to_vec(),
            data: (0..shape.iter().product::<usize>())
                .map(|i| i as f32)
                .collect(),
        };
        let tensors = BTreeMap::from([
            ("model.a.weight".to_string(), tensor(&[2, 2])),
            ("model.b".to_string(), tensor(&[3])),
        ]);
        let mut source = WeightSource::new("w.safetensors", &tensors, NameMap::prefix("model."));
        let mut b = ParamBuilder::load(&pool, &mut source);
        let a = b.scope("a").param("weight", &[2, 2], Init::Zeros).unwrap();
        assert_eq!(a.value.to_vec().unwrap(), [0.0, 1.0, 2.0, 3.0]);
        let e = b
            .scope("a")
            .param("weight", &[2, 2], Init::Zeros)
            .map(drop)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("model.a.weight would fill two parameters"),
            "{e}"
        );
        let e = b
            .param("b", &[4], Init::Zeros)
            .map(drop)
            .unwrap_err()
            .to_string();
        assert!(e.contains("model.b has shape [3]"), "{e}");
        let e = b
            .param("c", &[1], Init::Zeros)
            .map(drop)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no tensor model.c for the model's parameter c"),
            "{e}"
        );
        // A frozen builder makes parameters with no gradient buffer, drawn the same.
        let (mut r1, mut r2) = (Rng::new(9, stream::INIT), Rng::new(9, stream::INIT));
        let mut frozen = ParamBuilder::init(&pool, &mut r1).frozen();
        let f = frozen
            .scope("x")
            .param("w", &[3, 2], Init::Normal(1.0))
            .unwrap();
        let t = ParamBuilder::init(&pool, &mut r2)
            .param("w", &[3, 2], Init::Normal(1.0))
            .unwrap();
        assert!(f.frozen && f.grad.is_empty() && !t.frozen && t.grad.len() == 6);
        assert_eq!(f.value.to_vec().unwrap(), t.value.to_vec().unwrap());
        let e = source.finish().unwrap_err().to_string();
        assert_eq!(
            e,
            r#"w.safetensors: has 1 tensors the model does not use: ["model.b"]"#
        );
    }
}
