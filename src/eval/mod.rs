//! Evaluation of generated samples (as opposed to the loss of a checkpoint, which
//! `kiln eval` computes through `train`): how different the replies to one prompt are from
//! one another, and how many of them pass a checker.

pub mod diversity;
