//! The v1 contract seen from outside: round trips in both encodings, forward compatibility, and
//! the checked-in JSON Schema.

use shotfleet_schema::encoding::{self, ContentType, decode_job, parse_job};
use shotfleet_schema::{Floor, Limits, Lora, MemoryClass, ShotJob};

fn sample_job() -> ShotJob {
    ShotJob {
        v: 1,
        job_id: "ep01-s001".into(),
        project: "acme".into(),
        shot_id: "s001".into(),
        prompt: "a lighthouse in a storm, ink wash".into(),
        negative_prompt: Some("blurry".into()),
        width: 1024,
        height: 576,
        steps: 30,
        guidance: 6.5,
        seed: 42,
        images: 2,
        loras: vec![Lora { name: "ink-wash.v2".into(), weight: 0.8 }],
        floor: Some(Floor { min_side: 512, min_steps: 20 }),
        degrade: None,
    }
}

#[test]
fn jobs_round_trip_in_both_encodings() {
    let job = sample_job();
    for ct in [ContentType::Json, ContentType::MessagePack] {
        let bytes = encoding::encode(ct, &job);
        let back = parse_job(Some(ct.as_str()), &bytes, &Limits::default()).unwrap();
        assert_eq!(back, job, "{ct:?}");
    }
    // 1024 x 576 = 589,824 pixels: exactly 768 x 768, the top of class `s`.
    assert_eq!(job.class(), MemoryClass::S);
}

#[test]
fn msgpack_keeps_field_names_for_other_languages() {
    let bytes = encoding::encode(ContentType::MessagePack, &sample_job());
    // A map with named keys, not a positional array: `prompt` appears as a string key.
    assert!(bytes.windows(6).any(|w| w == b"prompt"));
}

#[test]
fn missing_header_means_json_and_defaults_apply() {
    let payload = br#"{"v":1,"job_id":"j1","project":"p","shot_id":"s","prompt":"x",
        "width":512,"height":512,"steps":20,"guidance":5,"seed":7}"#;
    let job = parse_job(None, payload, &Limits::default()).unwrap();
    assert_eq!(job.images, 1);
    assert!(job.loras.is_empty());
    assert_eq!(job.negative(), None);
}

#[test]
fn unknown_fields_are_ignored_for_forward_compatibility() {
    let payload = br#"{"v":1,"job_id":"j1","project":"p","shot_id":"s","prompt":"x",
        "width":512,"height":512,"steps":20,"guidance":5,"seed":7,
        "style_hint":"noir","extra":{"nested":[1,2,3]}}"#;
    assert!(decode_job(Some("application/json"), payload).is_ok());
    // Ignored, but named: a worker's result notes them, inside a LoRA entry and the floor too.
    let paths = |payload: &[u8]| -> Vec<(String, Option<&str>)> {
        encoding::unknown_job_fields(None, payload).into_iter().map(|f| (f.path, f.near)).collect()
    };
    assert_eq!(paths(payload), [("extra".to_owned(), None), ("style_hint".to_owned(), None)]);
    let nested = br#"{"v":1,"job_id":"j1","project":"p","shot_id":"s","prompt":"x","width":512,"height":512,"steps":20,
        "guidance":5,"seed":7,"lora":[],"loras":[{"name":"a","weight":1},{"name":"b","wieght":1,"strength":2}],"floor":{"min_side":64,"min_step":4}}"#;
    let expected = [
        ("floor.min_step", Some("min_steps")),
        ("lora", Some("loras")),
        ("loras[1].strength", None),
        ("loras[1].wieght", Some("weight")),
    ];
    assert_eq!(paths(nested), expected.map(|(path, near)| (path.to_owned(), near)));
    // A MessagePack field of the producer's own holding bytes, which JSON has no form for.
    let mut blob = encoding::encode(ContentType::MessagePack, &sample_job());
    blob[0] += 1; // one more field in the top map (a fixmap: its length is the low nibble)
    blob.extend([0xa4, b'b', b'l', b'o', b'b', 0xc4, 0x02, 0x01, 0x02]);
    assert!(decode_job(Some("application/msgpack"), &blob).is_ok());
    let named: Vec<String> = encoding::unknown_job_fields(Some("application/msgpack"), &blob).into_iter().map(|f| f.path).collect();
    assert_eq!(named, ["blob"]);
    let known = encoding::encode(ContentType::MessagePack, &sample_job());
    assert!(encoding::unknown_job_fields(Some(ContentType::MessagePack.as_str()), &known).is_empty());
}

#[test]
fn the_field_list_is_the_jobs() {
    let docs = shotfleet_schema::json_schema::documents();
    let job: serde_json::Value = serde_json::from_str(&docs[0].1).unwrap();
    let mut properties: Vec<&str> = job["properties"].as_object().unwrap().keys().map(String::as_str).collect();
    let mut fields = shotfleet_schema::job::FIELDS.to_vec();
    properties.sort_unstable();
    fields.sort_unstable();
    assert_eq!(properties, fields);
    for (def, fields) in [("Lora", shotfleet_schema::job::LORA_FIELDS), ("Floor", shotfleet_schema::job::FLOOR_FIELDS)] {
        let mut properties: Vec<&str> = job["$defs"][def]["properties"].as_object().unwrap().keys().map(String::as_str).collect();
        properties.sort_unstable();
        assert_eq!(properties, fields, "{def}");
    }
}

#[test]
fn what_other_languages_write_for_numbers_and_unset_fields_reads_as_meant() {
    // Python's json.dumps of floats that hold whole numbers, and of None for optional fields.
    let payload = br#"{"v":1.0,"job_id":"j1","project":"p","shot_id":"s","prompt":"x","negative_prompt":null,
        "width":768.0,"height":1.024e3,"steps":20.0,"guidance":5,"seed":7.0,"images":null,"loras":null,"floor":null}"#;
    let job = parse_job(None, payload, &Limits::default()).unwrap();
    assert_eq!((job.v, job.width, job.height, job.steps, job.seed, job.images), (1, 768, 1024, 20, 7, 1));
    assert!(job.loras.is_empty() && job.floor.is_none() && job.negative().is_none());
    let msgpack = rmp_serde::to_vec_named(&serde_json::json!({
        "v": 1, "job_id": "j1", "project": "p", "shot_id": "s", "prompt": "x",
        "width": 512.0, "height": 512, "steps": 20, "guidance": 5.0, "seed": 7, "images": 2.0,
        "loras": [{"name": "kai", "weight": 1}],
    }))
    .unwrap();
    let job = parse_job(Some("application/msgpack"), &msgpack, &Limits::default()).unwrap();
    assert_eq!((job.width, job.images, job.loras[0].weight.to_bits()), (512, 2, 1.0f32.to_bits()));
}

#[test]
fn json_schema_is_current() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("json");
    let bless = std::env::var_os("SHOTFLEET_BLESS").is_some();
    for (name, text) in shotfleet_schema::json_schema::documents() {
        let path = dir.join(name);
        if bless {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&path, &text).unwrap();
            continue;
        }
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == text,
            "{} drifted from the Rust types; regenerate with \
             `SHOTFLEET_BLESS=1 cargo test -p shotfleet-schema json_schema` and commit it",
            path.display()
        );
    }
}

#[test]
fn json_schema_describes_the_required_fields() {
    let docs = shotfleet_schema::json_schema::documents();
    let job: serde_json::Value = serde_json::from_str(&docs[0].1).unwrap();
    let required: Vec<&str> =
        job["required"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    for field in ["v", "job_id", "project", "shot_id", "prompt", "width", "height", "steps", "guidance", "seed"] {
        assert!(required.contains(&field), "{field} should be required");
    }
    assert!(!required.contains(&"images"), "images has a default");
}
