//! The memory store's recorded steps: kept beside the running record they belong to,
//! under the same lock, fenced by its token as a completion is.

use super::MemoryStore;
use crate::store::{Fenced, Lease, RecordedStep};

impl MemoryStore {
    /// The steps recorded under `lease`'s key, in order; `None`: the lease was lost.
    pub(super) fn steps_of(&self, lease: &Lease) -> Option<Vec<RecordedStep>> {
        let mut steps = None;
        let held = self.with_held(lease, |inner, id| {
            steps = Some(inner.steps.get(&id).cloned().unwrap_or_default());
        });
        steps.filter(|_| held.is_kept())
    }

    /// Records `step` under `lease`'s key if the lease still holds it, in its place:
    /// one recorded there before (by this lease, its answer lost) is written over.
    pub(super) fn record_step_held(&self, lease: &Lease, step: &RecordedStep) -> Fenced {
        self.with_held(lease, |inner, id| {
            let steps = inner.steps.entry(id).or_default();
            match steps.iter_mut().find(|s| s.n == step.n) {
                Some(recorded) => *recorded = step.clone(),
                None => {
                    steps.push(step.clone());
                    steps.sort_by_key(|s| s.n);
                }
            }
        })
    }
}
