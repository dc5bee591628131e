//! The LoRA pool on the tiny model: switches are rebinds while a set stays on the device, sets
//! leave least recently used first (to host memory, then dropped), its bytes are exact and
//! include evicted sets a render still holds, and it shrinks on demand.
mod pipeline_support;

use std::cell::Cell;
use std::sync::Arc;
use std::time::Duration;

use pipeline_support::{lora_adapter, tiny_pipeline};
use shotfleet_consumer::pipeline::Pipeline;
use shotfleet_consumer::pipeline::lora::{Adapter, LoraError, LoraPool, PoolLimits, SetKey, Source};

/// The sets used here: (key, adapters).
fn kohya() -> (SetKey, Vec<Adapter>) {
    (SetKey::new([("kohya", 1.0)]), vec![lora_adapter("kohya_sgm.safetensors", 1.0)])
}
fn peft() -> (SetKey, Vec<Adapter>) {
    (SetKey::new([("peft", 0.7)]), vec![lora_adapter("peft.safetensors", 0.7)])
}

/// Acquires `set`, counting calls of the loader in `loads`.
fn acquire(pool: &LoraPool, pipeline: &Pipeline, set: &(SetKey, Vec<Adapter>), loads: &Cell<u32>) -> (Arc<shotfleet_consumer::pipeline::lora::ResidentSet>, Source, Duration) {
    let acquired = pool
        .acquire(pipeline, &set.0, || -> Result<_, LoraError> {
            loads.set(loads.get() + 1);
            Ok(set.1.clone())
        })
        .expect("acquire")
        .expect("not the base model");
    (acquired.set, acquired.source, acquired.elapsed)
}

fn bytes(pipeline: &Pipeline, set: &(SetKey, Vec<Adapter>)) -> u64 {
    pipeline.lora_set_bytes(&set.1).unwrap()
}

#[test]
fn resident_sets_switch_by_rebinding_and_leave_least_recently_used_first() {
    let pipeline = tiny_pipeline();
    let (k, p) = (kohya(), peft());
    let (kb, pb) = (bytes(&pipeline, &k), bytes(&pipeline, &p));
    // Room for both on the device and in host memory.
    let pool = LoraPool::new(PoolLimits { device_bytes: kb + pb, host_bytes: kb + pb });
    let loads = Cell::new(0);
    let (set, source, _) = acquire(&pool, &pipeline, &k, &loads);
    assert_eq!((source, set.bytes(), pool.device_bytes()), (Source::Merged, kb, kb));
    drop(set);
    acquire(&pool, &pipeline, &p, &loads);
    assert_eq!(pool.device_bytes(), kb + pb);
    for _ in 0..3 {
        let (_, source, elapsed) = acquire(&pool, &pipeline, &k, &loads);
        assert_eq!(source, Source::Resident);
        assert!(elapsed < Duration::from_millis(50), "a switch between resident sets took {elapsed:?}");
        acquire(&pool, &pipeline, &p, &loads);
    }
    assert_eq!(loads.get(), 2, "each set merged once");
    let stats = pool.stats();
    assert_eq!((stats.merges, stats.resident_hits, stats.switches), (2, 6, 8));

    // Room for one on the device: kohya (used last before peft... peft used last) leaves.
    assert_eq!(pool.set_device_limit(pb), pb);
    assert_eq!(pool.whereabouts(&k.0), Some(Source::Host));
    assert!(pool.is_resident(&p.0) && !pool.is_resident(&k.0));
    let (_, source, _) = acquire(&pool, &pipeline, &k, &loads);
    assert_eq!(source, Source::Host, "placed again from host memory, not merged");
    assert_eq!(pool.whereabouts(&p.0), Some(Source::Host), "peft left for kohya");
    assert_eq!((pool.device_bytes(), loads.get()), (kb, 2));
}

#[test]
fn without_host_room_evicted_sets_are_dropped_and_merged_again() {
    let pipeline = tiny_pipeline();
    let (k, p) = (kohya(), peft());
    let pool = LoraPool::new(PoolLimits { device_bytes: bytes(&pipeline, &k), host_bytes: 0 });
    let loads = Cell::new(0);
    acquire(&pool, &pipeline, &k, &loads);
    assert_eq!(pool.host_bytes(), 0);
    acquire(&pool, &pipeline, &p, &loads);
    assert_eq!(pool.whereabouts(&k.0), None);
    let (_, source, _) = acquire(&pool, &pipeline, &k, &loads);
    assert_eq!((source, loads.get()), (Source::Merged, 3));
}

#[test]
fn a_set_in_use_counts_until_its_render_lets_go() {
    let pipeline = tiny_pipeline();
    let k = kohya();
    let kb = bytes(&pipeline, &k);
    let pool = LoraPool::new(PoolLimits { device_bytes: u64::MAX, host_bytes: u64::MAX });
    let loads = Cell::new(0);
    let (held, _, _) = acquire(&pool, &pipeline, &k, &loads);
    assert_eq!(pool.shrink_device_to(0), kb, "evicted, but a render still holds it");
    assert!(!pool.is_resident(&k.0));
    drop(held);
    assert_eq!(pool.device_bytes(), 0);
}

#[test]
fn the_budget_gets_back_only_sets_no_render_holds_least_recently_used_first() {
    let pipeline = tiny_pipeline();
    let (k, p) = (kohya(), peft());
    let (kb, pb) = (bytes(&pipeline, &k), bytes(&pipeline, &p));
    let pool = LoraPool::new(PoolLimits { device_bytes: u64::MAX, host_bytes: u64::MAX });
    let loads = Cell::new(0);
    drop(acquire(&pool, &pipeline, &k, &loads));
    let (held, _, _) = acquire(&pool, &pipeline, &p, &loads);
    assert_eq!((pool.device_bytes(), pool.idle_device_bytes()), (kb + pb, kb), "peft is in a render");
    assert_eq!((pool.bytes_of(&k.0), pool.bytes_of(&p.0)), (Some(kb), Some(pb)));
    // Asked for more than the idle sets hold, it gives what it can and keeps the held one.
    assert_eq!(pool.reclaim(kb + pb), kb);
    assert_eq!((pool.whereabouts(&k.0), pool.is_resident(&p.0)), (Some(Source::Host), true));
    assert_eq!(pool.reclaim(1), 0, "nothing idle left");
    drop(held);
    assert_eq!(pool.idle_device_bytes(), pb);
    // A switch is another set than the one acquired before; the same set again is none.
    let again = pool.acquire(&pipeline, &p.0, || -> Result<Vec<Adapter>, LoraError> { panic!("resident") }).unwrap().unwrap();
    assert!(!again.switched);
    let back = pool.acquire(&pipeline, &k.0, || -> Result<Vec<Adapter>, LoraError> { panic!("in host memory") }).unwrap().unwrap();
    assert!(back.switched && back.source == Source::Host);
}

#[test]
fn the_base_model_needs_no_set_and_weight_zero_is_the_base_model() {
    let pipeline = tiny_pipeline();
    let pool = LoraPool::new(PoolLimits { device_bytes: u64::MAX, host_bytes: u64::MAX });
    for key in [SetKey::new(Vec::<(String, f32)>::new()), SetKey::new([("kohya", 0.0)])] {
        assert!(key.is_base());
        let acquired = pool.acquire(&pipeline, &key, || -> Result<Vec<Adapter>, LoraError> { panic!("nothing to load") }).unwrap();
        assert!(acquired.is_none());
    }
    assert_eq!(SetKey::new([("b", 0.5), ("a", 1.0)]), SetKey::new([("a", 1.0), ("b", 0.5), ("c", 0.0)]));
}

#[test]
fn after_a_reload_sets_are_placed_again_from_host_memory() {
    let pipeline = tiny_pipeline();
    let k = kohya();
    let pool = LoraPool::new(PoolLimits { device_bytes: u64::MAX, host_bytes: u64::MAX });
    let loads = Cell::new(0);
    drop(acquire(&pool, &pipeline, &k, &loads));
    let pipeline = pipeline.reload().unwrap();
    let (set, source, _) = acquire(&pool, &pipeline, &k, &loads);
    assert_eq!((source, loads.get()), (Source::Host, 1));
    // And it renders on the new pipeline.
    let request = shotfleet_consumer::pipeline::RenderRequest {
        prompt: "a fox".into(),
        negative_prompt: None,
        width: 64,
        height: 64,
        steps: 2,
        guidance: 5.0,
        seed: 1,
        image_indices: vec![0],
        max_batch: 1,
    };
    pipeline
        .render_with_loras(&[request], Some(&set), &Default::default(), &mut |_| std::ops::ControlFlow::Continue(()))
        .unwrap();
}

#[test]
fn a_lora_that_does_not_fit_fails_the_acquire_and_leaves_the_pool_as_it_was() {
    let pipeline = tiny_pipeline();
    let pool = LoraPool::new(PoolLimits { device_bytes: u64::MAX, host_bytes: u64::MAX });
    let mut file = (*lora_adapter("peft.safetensors", 1.0).file).clone();
    file.targets[0].module = "down_blocks.3.resnets.0.conv1".into();
    let bad = Adapter { name: "other-model.v1".into(), file: Arc::new(file), weight: 1.0 };
    let key = SetKey::new([("other-model.v1", 1.0)]);
    let err = pool.acquire(&pipeline, &key, || -> Result<_, LoraError> { Ok(vec![bad]) }).err().expect("refused");
    assert!(err.is_invalid_job(), "{err}");
    assert_eq!((pool.device_bytes(), pool.host_bytes(), pool.whereabouts(&key)), (0, 0, None));
}
