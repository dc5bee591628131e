//! Storyboard order for LoRA sets: shots that share a set (the same LoRAs at the same weights)
//! are published one after another inside each priority, so a worker switches sets once per
//! character rather than once per shot (the seeds' grouping). The order is otherwise the
//! file's: priorities urgent first, sets in the order they first appear, shots of a set in file
//! order. `shotfleet submit --no-group` keeps the file's order as it is.

use std::collections::HashMap;

use crate::storyboard::Shot;

/// Reorders `shots` by priority, then by LoRA set in order of first appearance, stably.
pub fn group_by_lora_set(shots: &mut [Shot]) {
    let mut first_seen: HashMap<(shotfleet_schema::Priority, Vec<(String, u32)>), usize> = HashMap::new();
    let keys: Vec<(shotfleet_schema::Priority, usize)> = shots
        .iter()
        .map(|shot| {
            let next = first_seen.len();
            let seen = *first_seen.entry((shot.priority, shot.job.lora_set())).or_insert(next);
            (shot.priority, seen)
        })
        .collect();
    let mut order: Vec<usize> = (0..shots.len()).collect();
    order.sort_by_key(|&i| keys[i]);
    let sorted: Vec<Shot> = order.iter().map(|&i| shots[i].clone()).collect();
    shots.clone_from_slice(&sorted);
}

#[cfg(test)]
mod tests {
    use super::*;
    use shotfleet_schema::{Lora, Priority, ShotJob};

    fn shot(line: usize, priority: Priority, loras: &[(&str, f32)]) -> Shot {
        let job = ShotJob {
            v: 1,
            job_id: format!("j{line}"),
            project: "p".into(),
            shot_id: format!("s{line}"),
            prompt: "x".into(),
            negative_prompt: None,
            width: 64,
            height: 64,
            steps: 2,
            guidance: 5.0,
            seed: line as u64,
            images: 1,
            loras: loras.iter().map(|(n, w)| Lora { name: n.to_string(), weight: *w }).collect(),
            floor: None,
            degrade: None,
        };
        Shot { line, priority, job }
    }

    #[test]
    fn shots_of_a_set_come_together_inside_each_priority_in_file_order() {
        use Priority::{P0, P1};
        let mut shots = vec![
            shot(1, P1, &[("mei", 1.0)]),
            shot(2, P1, &[("kai", 1.0)]),
            shot(3, P0, &[("kai", 1.0)]),
            shot(4, P1, &[("mei", 1.0)]),
            shot(5, P1, &[]),
            shot(6, P1, &[("ink", 0.5), ("kai", 1.0)]),
            shot(7, P1, &[("kai", 1.0), ("ink", 0.5)]),
            shot(8, P1, &[("kai", 1.0), ("zero", 0.0)]),
            shot(9, P0, &[("mei", 1.0)]),
            shot(10, P1, &[("mei", 0.7)]),
        ];
        group_by_lora_set(&mut shots);
        let lines: Vec<usize> = shots.iter().map(|s| s.line).collect();
        assert_eq!(lines, [3, 9, 1, 4, 2, 8, 5, 6, 7, 10]);
    }
}
