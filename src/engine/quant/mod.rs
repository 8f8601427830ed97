//! Quantised weight formats: frozen weights held in few bits on a device and expanded to a
//! compute type when a layer needs them.
//!
//! A quantised weight lives in its device's pool like a tensor (its bytes are booked there)
//! and is expanded by a kernel dispatched through [`crate::engine::ops`], with a CPU
//! reference of the same arithmetic, into a [`DequantWorkspace`] that the layers of a model
//! share.

pub mod nf4;
pub mod workspace;

pub use nf4::Nf4Weight;
pub use workspace::DequantWorkspace;
