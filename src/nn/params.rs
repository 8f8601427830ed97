//! Visiting a layer's parameters, declared once.
//!
//! Every layer and model lists the fields that hold its parameters in one [`params!`] line;
//! the macro derives both traversals of [`Params`] from that list, read-only and mutable, so
//! the two can never disagree. A field may be a [`Param`], another layer, an `Option`, a
//! `Vec` or a pair of them, and may be visited only when a condition of the layer holds.
//!
//! The order of the list is the order of the parameters, which the optimizer, checkpoints,
//! data-parallel buckets and gradient-ready indices rely on: change it only with them.

use super::Param;

/// Something that holds parameters, visited in a fixed order.
pub trait Params {
    /// Calls `f` on every parameter, frozen ones included, in order.
    fn visit<'a>(&'a self, f: &mut dyn FnMut(&'a Param));

    /// [`Params::visit`] with mutable access.
    fn visit_mut<'a>(&'a mut self, f: &mut dyn FnMut(&'a mut Param));

    /// Every parameter, frozen ones included, in order (imports and exports map them by
    /// name).
    fn params(&self) -> Vec<&Param> {
        let mut v = Vec::new();
        self.visit(&mut |p| v.push(p));
        v
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut v = Vec::new();
        self.visit_mut(&mut |p| v.push(p));
        v
    }

    /// The parameters that train, in order (the optimizer and checkpoints rely on it): all
    /// of them, or only the adapters over a frozen base.
    fn trainable_params(&self) -> Vec<&Param> {
        let mut v = Vec::new();
        self.visit(&mut |p| {
            if !p.frozen {
                v.push(p)
            }
        });
        v
    }

    fn trainable_params_mut(&mut self) -> Vec<&mut Param> {
        let mut v = Vec::new();
        self.visit_mut(&mut |p| {
            if !p.frozen {
                v.push(p)
            }
        });
        v
    }

    /// How many parameters train.
    fn trainable_count(&self) -> usize {
        let mut n = 0;
        self.visit(&mut |p| n += usize::from(!p.frozen));
        n
    }
}

/// Implements [`Params`] for a type from the list of its fields that hold parameters, in
/// order:
///
/// ```ignore
/// params!(Linear { weight, bias, adapters });
/// params!(BkCore { z if opts.learn_z, offdiag });
/// params!(impl[E: TokenEmbedding, B: Block] Lm<E, B> { embed, blocks, ln_f, head });
/// ```
///
/// `field if path` visits the field only while `self.path` is true.
macro_rules! params {
    (impl[$($generics:tt)*] $ty:ty { $($field:tt $(if $($cond:ident).+)?),* $(,)? }) => {
        impl<$($generics)*> $crate::nn::params::Params for $ty {
            fn visit<'a>(&'a self, f: &mut dyn FnMut(&'a $crate::nn::Param)) {
                $(
                    if true $(&& self.$($cond).+)? {
                        $crate::nn::params::Params::visit(&self.$field, f);
                    }
                )*
            }

            fn visit_mut<'a>(&'a mut self, f: &mut dyn FnMut(&'a mut $crate::nn::Param)) {
                $(
                    if true $(&& self.$($cond).+)? {
                        $crate::nn::params::Params::visit_mut(&mut self.$field, f);
                    }
                )*
            }
        }
    };
    ($ty:ty { $($body:tt)* }) => {
        $crate::nn::params::params!(impl[] $ty { $($body)* });
    };
}
pub(crate) use params;

impl Params for Param {
    fn visit<'a>(&'a self, f: &mut dyn FnMut(&'a Param)) {
        f(self)
    }

    fn visit_mut<'a>(&'a mut self, f: &mut dyn FnMut(&'a mut Param)) {
        f(self)
    }
}

impl<T: Params> Params for Option<T> {
    fn visit<'a>(&'a self, f: &mut dyn FnMut(&'a Param)) {
        if let Some(t) = self {
            t.visit(f)
        }
    }

    fn visit_mut<'a>(&'a mut self, f: &mut dyn FnMut(&'a mut Param)) {
        if let Some(t) = self {
            t.visit_mut(f)
        }
    }
}

impl<T: Params> Params for Vec<T> {
    fn visit<'a>(&'a self, f: &mut dyn FnMut(&'a Param)) {
        self.iter().for_each(|t| t.visit(f))
    }

    fn visit_mut<'a>(&'a mut self, f: &mut dyn FnMut(&'a mut Param)) {
        self.iter_mut().for_each(|t| t.visit_mut(f))
    }
}

impl<A: Params, B: Params> Params for (A, B) {
    fn visit<'a>(&'a self, f: &mut dyn FnMut(&'a Param)) {
        self.0.visit(f);
        self.1.visit(f);
    }

    fn visit_mut<'a>(&'a mut self, f: &mut dyn FnMut(&'a mut Param)) {
        self.0.visit_mut(f);
        self.1.visit_mut(f);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::rng::{Rng, stream};
    use crate::engine::{Device, MemoryPool};
    use crate::nn::Init;

    struct Inner {
        a: Param,
        b: Option<Param>,
    }
    params!(Inner { a, b });

    struct Outer {
        first: Param,
        pair: Option<(Inner, Inner)>,
        many: Vec<Inner>,
        gated: Param,
        opts: Opts,
    }
    struct Opts {
        with_gated: bool,
    }
    params!(Outer { first, gated if opts.with_gated, pair, many });

    /// The declared order, through options, pairs, vectors and a condition, alike in both
    /// traversals; frozen parameters are left out of the trainable ones only.
    #[test]
    fn both_traversals_follow_the_declared_order() {
        let pool = MemoryPool::new(Device::Cpu);
        let p = |name: &str| {
            Param::initialised(
                &pool,
                name.into(),
                &[1],
                Init::Zeros,
                &mut Rng::new(0, stream::INIT),
                false,
            )
            .unwrap()
        };
        let inner = |a: &str, b: Option<&str>| Inner {
            a: p(a),
            b: b.map(p),
        };
        let mut outer = Outer {
            first: p("first"),
            pair: Some((inner("p0.a", None), inner("p1.a", Some("p1.b")))),
            many: vec![inner("m0.a", Some("m0.b")), inner("m1.a", None)],
            gated: p("gated"),
            opts: Opts { with_gated: true },
        };
        let names = |v: Vec<&Param>| v.iter().map(|p| p.name.clone()).collect::<Vec<_>>();
        let all = [
            "first", "gated", "p0.a", "p1.a", "p1.b", "m0.a", "m0.b", "m1.a",
        ];
        assert_eq!(names(outer.params()), all);
        let mutable: Vec<String> = outer.params_mut().iter().map(|p| p.name.clone()).collect();
        assert_eq!(mutable, all);
        outer.opts.with_gated = false;
        outer.many[0].a.freeze().unwrap();
        let trainable = ["first", "p0.a", "p1.a", "p1.b", "m0.b", "m1.a"];
        assert_eq!(names(outer.trainable_params()), trainable);
        assert_eq!(outer.trainable_count(), trainable.len());
        let mutable: Vec<String> = outer
            .trainable_params_mut()
            .iter()
            .map(|p| p.name.clone())
            .collect();
        assert_eq!(mutable, trainable);
    }
}
