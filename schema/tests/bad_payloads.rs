//! A corpus of malformed payloads: each is rejected with a specific error, never a panic.

use shotfleet_schema::encoding::{DecodeError, InvalidJob, parse_job};
use shotfleet_schema::Limits;

const GOOD: &str = r#"{"v":1,"job_id":"j1","project":"acme","shot_id":"s1","prompt":"a cat",
    "width":512,"height":512,"steps":20,"guidance":5.0,"seed":1}"#;

fn json_with(field: &str, value: &str) -> Vec<u8> {
    let mut v: serde_json::Value = serde_json::from_str(GOOD).unwrap();
    v[field] = serde_json::from_str(value).unwrap();
    serde_json::to_vec(&v).unwrap()
}

/// What a case expects: a decode error whose text contains `needle`, or a validation problem on
/// `field` whose message contains `needle`.
enum Expect {
    Decode(&'static str),
    Field(&'static str, &'static str),
}

fn check(name: &str, content_type: Option<&str>, payload: &[u8], expect: Expect) {
    let outcome = parse_job(content_type, payload, &Limits::default());
    match (outcome, expect) {
        (Err(InvalidJob::Decode(e)), Expect::Decode(needle)) => {
            assert!(e.to_string().contains(needle), "{name}: `{e}` should mention `{needle}`");
        }
        (Err(InvalidJob::Invalid(e)), Expect::Field(field, needle)) => {
            let hit = e.problems.iter().any(|p| p.field == field && p.message.contains(needle));
            assert!(hit, "{name}: `{e}` should say `{needle}` about `{field}`");
        }
        (other, _) => panic!("{name}: unexpected outcome {other:?}"),
    }
}

fn msgpack(value: &serde_json::Value) -> Vec<u8> {
    rmp_serde::to_vec_named(value).unwrap()
}

#[test]
fn decode_errors_are_specific() {
    let good: serde_json::Value = serde_json::from_str(GOOD).unwrap();
    let full = msgpack(&good);
    check("truncated msgpack", Some("application/msgpack"), &full[..full.len() / 2], Expect::Decode("MessagePack"));
    check("empty payload", None, b"", Expect::Decode("empty"));
    check("empty object", None, b"{}", Expect::Decode("`v`"));
    check("unknown version", None, &json_with("v", "2"), Expect::Decode("version 2"));
    check("version as string", None, &json_with("v", "\"1\""), Expect::Decode("at `v`"));
    check("wrong type", None, &json_with("width", "\"wide\""), Expect::Decode("at `width`"));
    check("negative size", None, &json_with("height", "-8"), Expect::Decode("at `height`"));
    check("huge number", None, &json_with("width", "99999999999999"), Expect::Decode("at `width`"));
    check("seed beyond u64", None, &json_with("seed", "1e30"), Expect::Decode("at `seed`"));
    check("lora not a list", None, &json_with("loras", "{}"), Expect::Decode("at `loras`"));
    check("fraction for an integer", None, &json_with("steps", "20.5"), Expect::Decode("20.5 is not a whole number"));
    check("guidance past f32", None, &json_with("guidance", "1e308"), Expect::Decode("1e308 is past what a 32-bit float holds"));
    // Python's json.dumps writes these unless told allow_nan=False.
    let python = |literal: &str| GOOD.replace(r#""guidance":5.0"#, &format!(r#""guidance":{literal}"#)).into_bytes();
    check("python NaN", None, &python("NaN"), Expect::Decode("allow_nan=False"));
    check("python -Infinity", None, &python("-Infinity"), Expect::Decode("allow_nan=False"));
    // MessagePack sent as JSON, its prompt holding the word: no Python to blame.
    let mut pool: serde_json::Value = serde_json::from_str(GOOD).unwrap();
    pool["prompt"] = "an Infinity pool at NaN o'clock".into();
    let error = parse_job(None, &msgpack(&pool), &Limits::default()).unwrap_err().to_string();
    assert!(error.contains("this looks like MessagePack") && !error.contains("allow_nan"), "{error}");
    // An unknown field nested deeper than any stack: named, never a crash (it aborted workers).
    let mut deep = msgpack(&good);
    deep[0] += 1; // one more field in the top map (fixmap: the low nibble is its length)
    deep.extend(rmp_serde::to_vec(&"x").unwrap());
    deep.extend(std::iter::repeat_n(0x91u8, 60_000));
    deep.push(0x90);
    // On a stack of a Tokio worker thread's size, where a worker decodes.
    let on_small_stack = std::thread::Builder::new().stack_size(2 << 20);
    on_small_stack
        .spawn(move || check("deep msgpack", Some("application/msgpack"), &deep, Expect::Decode("depth limit exceeded")))
        .unwrap()
        .join()
        .unwrap();
    let mut deep_json = br#"{"v":1,"x":"#.to_vec();
    deep_json.extend(std::iter::repeat_n(b'[', 60_000));
    check("deep json", None, &deep_json, Expect::Decode("EOF while parsing a list"));
    check("bom", None, &[b"\xEF\xBB\xBF".as_slice(), GOOD.as_bytes()].concat(), Expect::Decode("byte order mark"));
    check("trailing garbage", None, &[GOOD.as_bytes(), b"}"].concat(), Expect::Decode("trailing"));
    check("not json", None, b"prompt=a cat", Expect::Decode("malformed JSON"));
    check("json array", None, br#"[1, "j1"]"#, Expect::Decode("a job is a map of named fields"));
    check("msgpack array", Some("application/msgpack"), &msgpack(&serde_json::json!([1, "j1", "acme"])), Expect::Decode("a job is a map of named fields"));
    check("unknown content type", Some("text/yaml"), GOOD.as_bytes(), Expect::Decode("Content-Type"));
    check("json sent as msgpack", Some("application/msgpack"), GOOD.as_bytes(), Expect::Decode("this looks like JSON"));
    // One value per message, in either format.
    check("trailing msgpack", Some("application/msgpack"), &[full.as_slice(), b"\xc0\xc0"].concat(), Expect::Decode("2 byte(s) follow"));
    check("msgpack sent as json", None, &full, Expect::Decode("send it with `Content-Type: application/msgpack`"));

    let mut big = good.clone();
    big["prompt"] = serde_json::Value::String("x".repeat(10 * 1024 * 1024));
    check("10 MB prompt", None, &serde_json::to_vec(&big).unwrap(), Expect::Decode("limit"));

    // A MessagePack string holding bytes that are not UTF-8: 0xa2 = fixstr of 2 bytes.
    let mut bad_utf8 = msgpack(&good);
    let at = bad_utf8.windows(6).position(|w| w == b"\xa5a cat").expect("prompt in payload");
    bad_utf8.splice(at..at + 6, [0xa5, b'a', 0xff, 0xfe, b'a', b't']);
    check("non-UTF-8 string", Some("application/msgpack"), &bad_utf8, Expect::Decode("prompt"));
    // The same in JSON: a raw 0xff byte inside a string.
    let raw = GOOD.replace("a cat", "a \u{1}cat").into_bytes();
    let mut raw_bad = raw.clone();
    let at = raw_bad.iter().position(|b| *b == 1).unwrap();
    raw_bad[at] = 0xff;
    check("non-UTF-8 JSON", None, &raw_bad, Expect::Decode("malformed JSON"));
}

#[test]
fn validation_errors_name_the_field() {
    // JSON has no NaN; MessagePack does.
    check("nan guidance", Some("application/msgpack"), &{
        let mut job: shotfleet_schema::ShotJob = serde_json::from_str(GOOD).unwrap();
        job.guidance = f32::NAN;
        rmp_serde::to_vec_named(&job).unwrap()
    }, Expect::Field("guidance", "finite"));
    check("infinite guidance", Some("application/msgpack"), &{
        let mut job: shotfleet_schema::ShotJob = serde_json::from_str(GOOD).unwrap();
        job.guidance = f32::INFINITY;
        rmp_serde::to_vec_named(&job).unwrap()
    }, Expect::Field("guidance", "finite"));
    check("dotdot id", None, &json_with("job_id", "\"../../etc\""), Expect::Field("job_id", "'.'"));
    check("slash in project", None, &json_with("project", "\"a/b\""), Expect::Field("project", "'/'"));
    check("dot in shot", None, &json_with("shot_id", "\"s.1\""), Expect::Field("shot_id", "'.'"));
    check("dotdot lora", None, &json_with("loras", r#"[{"name":"..","weight":1}]"#), Expect::Field("loras[0].name", "`..`"));
    check("lora path", None, &json_with("loras", r#"[{"name":"a/b.safetensors","weight":1}]"#), Expect::Field("loras[0].name", "'/'"));
    check("lora weight", None, &json_with("loras", r#"[{"name":"ok","weight":1e9}]"#), Expect::Field("loras[0].weight", "outside"));
    let twice = r#"[{"name":"hero","weight":0.8},{"name":"ink","weight":0.5},{"name":"hero","weight":0.4}]"#;
    check("lora listed twice", None, &json_with("loras", twice), Expect::Field("loras[2].name", "listed twice (also loras[0])"));
    check("long id", None, &json_with("job_id", &format!("\"{}\"", "j".repeat(200))), Expect::Field("job_id", "bytes"));
    check("empty prompt", None, &json_with("prompt", "\"   \""), Expect::Field("prompt", "empty"));
    check("long prompt", None, &json_with("prompt", &format!("\"{}\"", "p".repeat(9000))), Expect::Field("prompt", "bytes"));
    check("not multiple of 8", None, &json_with("width", "513"), Expect::Field("width", "multiple of 8 (e.g. 512)"));
    // Limits with no multiple of 64 between them (a worker's [limits]) still give a hint, no panic.
    let narrow = Limits { min_side: 1000, max_side: 1000, ..Limits::default() };
    let e = parse_job(None, &json_with("width", "1001"), &narrow).unwrap_err().to_string();
    assert!(e.contains("1001 must be a positive multiple of 8 (e.g. 1000)"), "{e}");
    check("zero size", None, &json_with("height", "0"), Expect::Field("height", "positive multiple of 8 (e.g. 64)"));
    check("100000 px", None, &json_with("width", "100000"), Expect::Field("width", "outside"));
    check("zero steps", None, &json_with("steps", "0"), Expect::Field("steps", "outside"));
    check("too many images", None, &json_with("images", "1000"), Expect::Field("images", "outside"));
    check("floor above size", None, &json_with("floor", r#"{"min_side":1024,"min_steps":5}"#), Expect::Field("floor.min_side", "shorter side"));
    check("floor steps", None, &json_with("floor", r#"{"min_side":256,"min_steps":50}"#), Expect::Field("floor.min_steps", "steps"));
    // `degrade` is a worker's record of the rungs taken; one a producer wrote by hand is refused
    // where it cannot be a worker's (a rung count with no room for the next rung, an "original"
    // no larger than the job).
    let degrade = |level: u64, width: u32, steps: u32| {
        json_with("degrade", &format!(r#"{{"level":{level},"from":{{"width":{width},"height":1024,"steps":{steps}}}}}"#))
    };
    check("degrade level 0", None, &degrade(0, 1024, 20), Expect::Field("degrade.level", "a producer omits it"));
    check("degrade level at the top", None, &degrade(u64::from(u32::MAX), 1024, 20), Expect::Field("degrade.level", "1..=32"));
    check("degrade from smaller", None, &degrade(1, 256, 20), Expect::Field("degrade.from", "not a larger original"));
    check("degrade from other steps", None, &degrade(1, 1024, 30), Expect::Field("degrade.from", "at 30 steps"));
    assert!(parse_job(None, &degrade(1, 1024, 20), &Limits::default()).is_ok(), "a worker's rung from 1024x1024 to 512x512");
}

#[test]
fn a_job_that_asks_for_more_work_than_a_card_does_in_its_time_limit_is_refused() {
    // Each bound alone is respected: 2048x2048, 8 images, 150 steps (5,033 megapixel-steps).
    let mut v: serde_json::Value = serde_json::from_str(GOOD).unwrap();
    for (field, value) in [("width", 2048), ("height", 2048), ("images", 8), ("steps", 150)] {
        v[field] = value.into();
    }
    let err = parse_job(None, v.to_string().as_bytes(), &Limits::default()).unwrap_err().to_string();
    assert!(err.contains("2048x2048 x 8 image(s) x 150 steps is 5033 megapixel-steps; at most 1000"), "{err}");
    assert!(err.contains("split the images over several jobs"), "{err}");
    // 1536x1536 x 4 images x 50 steps (472) is a job the fleet takes.
    for (field, value) in [("width", 1536), ("height", 1536), ("images", 4), ("steps", 50)] {
        v[field] = value.into();
    }
    parse_job(None, v.to_string().as_bytes(), &Limits::default()).unwrap();
}

#[test]
fn every_problem_is_reported_at_once() {
    let mut v: serde_json::Value = serde_json::from_str(GOOD).unwrap();
    v["width"] = 7.into();
    v["steps"] = 0.into();
    v["project"] = "a b".into();
    let err = parse_job(None, &serde_json::to_vec(&v).unwrap(), &Limits::default()).unwrap_err();
    let InvalidJob::Invalid(err) = err else { panic!("{err:?}") };
    let fields: Vec<&str> = err.problems.iter().map(|p| p.field.as_str()).collect();
    assert_eq!(fields, ["project", "width", "steps"]);
}

#[test]
fn decode_error_type_is_exported() {
    // Callers match on the kind to decide what to do; keep the variants reachable.
    let e = parse_job(None, b"", &Limits::default()).unwrap_err();
    assert!(matches!(e, InvalidJob::Decode(DecodeError::Empty)));
}

#[test]
fn a_payload_that_does_not_decode_may_still_name_its_job() {
    use shotfleet_schema::encoding::read_ids;
    let ids = |content_type: Option<&str>, payload: &[u8]| read_ids(content_type, payload, "acme").map(|ids| (ids.job_id, ids.project, ids.shot_id));
    let named = |job: &str, shot: &str| Some((job.to_string(), "acme".to_string(), shot.to_string()));
    // A field of the wrong type; the project is the subject's, whatever the payload says.
    let wrong = br#"{"v":1,"job_id":"j1","project":"beta","shot_id":"s1","guidance":"5"}"#;
    assert_eq!(ids(None, wrong), named("j1", "s1"));
    // Another version, a byte order mark, a wrong Content-Type, MessagePack sent without one.
    assert_eq!(ids(None, br#"{"v":2,"job_id":"j2"}"#), named("j2", ""));
    assert_eq!(ids(None, &[b"\xEF\xBB\xBF".as_slice(), wrong].concat()), named("j1", "s1"));
    assert_eq!(ids(Some("text/plain"), wrong), named("j1", "s1"));
    let packed = msgpack(&serde_json::json!({"job_id": "j3", "shot_id": 7, "width": "wide"}));
    assert_eq!(ids(None, &packed), named("j3", ""), "a shot id of the wrong type is left empty");
    // A float Python wrote as NaN (no JSON) hides no id; the same words inside strings are text.
    let python = br#"{"v":1,"job_id":"j5","shot_id":"s5","guidance":NaN,"seed":-Infinity,"prompt":"NaN \"Infinity\""}"#;
    assert_eq!(ids(None, python), named("j5", "s5"));
    // An unknown field nested deeper than a decode may go (it fails as `invalid`) hides no id.
    let mut deep = msgpack(&serde_json::json!({"job_id": "j6", "shot_id": "s6"}));
    deep[0] += 1;
    deep.extend(rmp_serde::to_vec(&"x").unwrap());
    deep.extend(std::iter::repeat_n(0x91u8, 60_000));
    deep.push(0x90);
    assert_eq!(ids(Some("application/msgpack"), &deep), named("j6", "s6"));
    let mut deep_json = br#"{"job_id":"j7","x":"#.to_vec();
    deep_json.extend(std::iter::repeat_n(b'[', 60_000));
    deep_json.extend(std::iter::repeat_n(b']', 60_000));
    deep_json.push(b'}');
    assert_eq!(ids(None, &deep_json), named("j7", ""));
    // An id that is no id is still read as sent, for a person looking for the job by it.
    use shotfleet_schema::encoding::read_job_id_as_sent;
    assert_eq!(read_job_id_as_sent(None, br#"{"v":1,"job_id":"a/b"}"#).as_deref(), Some("a/b"));
    assert_eq!(read_job_id_as_sent(None, br#"{"v":1,"job_id":7}"#), None);
    // Nothing to name it by: no id, an id that is no id, not a map, not a payload at all.
    assert_eq!(ids(None, br#"{"v":1,"job_id":7}"#), None);
    assert_eq!(ids(None, br#"{"v":1,"job_id":"a/b"}"#), None);
    assert_eq!(ids(None, br#"[1,2]"#), None);
    assert_eq!(ids(None, br#"["j4","s4"]"#), None, "fields in order name no job");
    assert_eq!(ids(None, b"prompt=a cat"), None);
    // Refused for its size or for what follows it, a payload still names its job.
    let mut big: serde_json::Value = serde_json::from_str(GOOD).unwrap();
    big["notes"] = serde_json::Value::String("x".repeat(70_000));
    assert_eq!(ids(None, &serde_json::to_vec(&big).unwrap()), named("j1", "s1"));
    assert_eq!(ids(None, &[GOOD.as_bytes(), b"xyz"].concat()), named("j1", "s1"));
    let good: serde_json::Value = serde_json::from_str(GOOD).unwrap();
    assert_eq!(ids(Some("application/msgpack"), &[msgpack(&good).as_slice(), b"\xc0"].concat()), named("j1", "s1"));
}
