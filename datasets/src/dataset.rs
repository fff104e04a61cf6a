//! Plugging packed micro-batches into burn's data loading, with background prefetch.
//!
//! [`PackedDataset`] implements burn's [`Dataset`] (item = one packed [`MicroBatch`]), so burn's
//! dataset combinators and data loaders accept it. [`Prefetcher`] walks any dataset on a background
//! thread, keeping up to `depth` items ready, so packing/copying overlaps training.

use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;

use burn_dataset::Dataset;

use crate::packing::{MicroBatch, Packing};

/// The micro-batches of a [`Packing`] as a burn dataset.
#[derive(Clone, Debug)]
pub struct PackedDataset {
    batches: Arc<Vec<MicroBatch>>,
}

impl PackedDataset {
    pub fn new(packing: Packing) -> Self {
        Self {
            batches: Arc::new(packing.micro_batches),
        }
    }
}

impl Dataset<MicroBatch> for PackedDataset {
    fn get(&self, index: usize) -> Option<MicroBatch> {
        self.batches.get(index).cloned()
    }

    fn len(&self) -> usize {
        self.batches.len()
    }
}

/// Iterates a dataset in order on a background thread, `depth` items ahead.
pub struct Prefetcher<I> {
    receiver: Receiver<I>,
    worker: Option<JoinHandle<()>>,
}

impl<I: Send + 'static> Prefetcher<I> {
    pub fn new<D: Dataset<I> + 'static>(dataset: D, depth: usize) -> Self {
        let (sender, receiver) = sync_channel(depth.max(1));
        let worker = std::thread::spawn(move || {
            for index in 0..dataset.len() {
                let Some(item) = dataset.get(index) else {
                    break;
                };
                if sender.send(item).is_err() {
                    break;
                }
            }
        });
        Self {
            receiver,
            worker: Some(worker),
        }
    }
}

impl<I> Iterator for Prefetcher<I> {
    type Item = I;

    fn next(&mut self) -> Option<I> {
        self.receiver.recv().ok()
    }
}

impl<I> Drop for Prefetcher<I> {
    fn drop(&mut self) {
        // Dropping the receiver makes the worker's next send fail, so it ends; join it.
        let (_, empty) = sync_channel(1);
        drop(std::mem::replace(&mut self.receiver, empty));
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}
