use super::*;
use rmp::encode as enc;

fn s(buf: &mut Vec<u8>, v: &str) {
    enc::write_str(buf, v).unwrap();
}

/// A legacy tagged-array batch with a stored (int64 and bytes hashes), a
/// removed, a cleared and an unknown event, no dp rank.
fn legacy_batch() -> Vec<u8> {
    let mut b = Vec::new();
    enc::write_array_len(&mut b, 2).unwrap();
    enc::write_f64(&mut b, 12.5).unwrap();
    enc::write_array_len(&mut b, 4).unwrap();
    // ["BlockStored", [h1, h2], parent, tokens, block_size, lora_id, medium]
    enc::write_array_len(&mut b, 7).unwrap();
    s(&mut b, "BlockStored");
    enc::write_array_len(&mut b, 2).unwrap();
    enc::write_i64(&mut b, -2).unwrap();
    enc::write_bin(&mut b, &[9; 32]).unwrap();
    enc::write_u64(&mut b, 77).unwrap();
    enc::write_array_len(&mut b, 4).unwrap();
    for t in [1u32, 2, 70_000, 4] {
        enc::write_uint(&mut b, u64::from(t)).unwrap();
    }
    enc::write_uint(&mut b, 2).unwrap();
    enc::write_nil(&mut b).unwrap();
    s(&mut b, "cpu");
    enc::write_array_len(&mut b, 3).unwrap();
    s(&mut b, "BlockRemoved");
    enc::write_array_len(&mut b, 1).unwrap();
    enc::write_u64(&mut b, u64::MAX).unwrap();
    enc::write_nil(&mut b).unwrap();
    enc::write_array_len(&mut b, 1).unwrap();
    s(&mut b, "AllBlocksCleared");
    enc::write_array_len(&mut b, 2).unwrap();
    s(&mut b, "SomethingNew");
    enc::write_map_len(&mut b, 1).unwrap();
    s(&mut b, "x");
    enc::write_array_len(&mut b, 1).unwrap();
    enc::write_nil(&mut b).unwrap();
    b
}

#[test]
fn decodes_legacy_arrays_with_every_hash_form() {
    let batch = decode_batch(&legacy_batch()).unwrap();
    assert_eq!(batch.ts, 12.5);
    assert_eq!(batch.dp_rank, None);
    assert_eq!(batch.unknown_events, 1);
    assert_eq!(batch.events.len(), 3);
    let KvEvent::BlockStored(st) = &batch.events[0] else {
        panic!("not stored")
    };
    assert_eq!(st.block_hashes, [u64::MAX - 1, 0x0909_0909_0909_0909]);
    assert_eq!(st.parent_block_hash, Some(77));
    assert_eq!(st.token_ids, [1, 2, 70_000, 4]);
    assert_eq!(st.block_size, 2);
    assert_eq!(st.medium, Medium::Cpu);
    assert!(st.is_main_group());
    let KvEvent::BlockRemoved(rm) = &batch.events[1] else {
        panic!("not removed")
    };
    assert_eq!(rm.block_hashes, [u64::MAX]);
    assert_eq!(rm.medium, Medium::Gpu);
    assert_eq!(batch.events[2], KvEvent::AllBlocksCleared);
}

#[test]
fn decodes_map_batches_and_map_events_in_any_key_order() {
    let mut b = Vec::new();
    enc::write_map_len(&mut b, 4).unwrap();
    s(&mut b, "future");
    enc::write_nil(&mut b).unwrap();
    s(&mut b, "events");
    enc::write_array_len(&mut b, 1).unwrap();
    enc::write_map_len(&mut b, 6).unwrap();
    s(&mut b, "token_ids");
    enc::write_array_len(&mut b, 2).unwrap();
    // A bigram pair keeps its first id.
    enc::write_array_len(&mut b, 2).unwrap();
    enc::write_uint(&mut b, 5).unwrap();
    enc::write_uint(&mut b, 6).unwrap();
    enc::write_uint(&mut b, 7).unwrap();
    s(&mut b, "block_hashes");
    enc::write_array_len(&mut b, 1).unwrap();
    enc::write_bin(&mut b, &[1, 2]).unwrap();
    s(&mut b, "type");
    s(&mut b, "BlockStored");
    s(&mut b, "extra_keys");
    enc::write_array_len(&mut b, 1).unwrap();
    enc::write_array_len(&mut b, 2).unwrap();
    s(&mut b, "my-lora");
    s(&mut b, "tenant-b");
    s(&mut b, "lora_name");
    s(&mut b, "my-lora");
    s(&mut b, "group_idx");
    enc::write_uint(&mut b, 1).unwrap();
    s(&mut b, "ts");
    enc::write_uint(&mut b, 3).unwrap();
    s(&mut b, "data_parallel_rank");
    enc::write_uint(&mut b, 2).unwrap();
    let batch = decode_batch(&b).unwrap();
    assert_eq!((batch.ts, batch.dp_rank), (3.0, Some(2)));
    let KvEvent::BlockStored(st) = &batch.events[0] else {
        panic!("not stored")
    };
    assert_eq!(st.token_ids, [5, 7]);
    assert_eq!(st.block_hashes, [0x0102]);
    assert_eq!(st.salt(), Some("tenant-b"));
    assert!(!st.is_main_group());
}

#[test]
fn wrong_types_and_truncation_are_errors() {
    let good = legacy_batch();
    for cut in 0..good.len() {
        assert!(decode_batch(&good[..cut]).is_err(), "cut at {cut}");
    }
    let mut extra = good.clone();
    extra.push(0xc0);
    assert_eq!(decode_batch(&extra), Err(DecodeError::Trailing(1)));
    let mut b = Vec::new();
    enc::write_array_len(&mut b, 2).unwrap();
    enc::write_f64(&mut b, 1.0).unwrap();
    enc::write_array_len(&mut b, 1).unwrap();
    enc::write_map_len(&mut b, 2).unwrap();
    s(&mut b, "type");
    s(&mut b, "BlockStored");
    s(&mut b, "block_hashes");
    s(&mut b, "oops");
    assert!(matches!(
        decode_batch(&b),
        Err(DecodeError::Type {
            field: "block_hashes",
            ..
        })
    ));
    // An array claiming 4 billion events in a 10-byte payload.
    let huge = [
        0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff,
    ];
    assert_eq!(decode_batch(&huge), Err(DecodeError::TooLong));
}

#[test]
fn frames_replay_replies_and_topics() {
    let payload = legacy_batch();
    let seq = 5u64.to_be_bytes();
    let msg = decode_message(&[&b"kv@10.0.0.1:8000@llama"[..], &seq, &payload]).unwrap();
    assert_eq!(msg.seq, 5);
    let t = parse_topic(&msg.topic).unwrap();
    assert_eq!((t.pod, t.model), ("10.0.0.1:8000", "llama"));
    assert_eq!(parse_topic("kv"), None);
    assert!(decode_message(&[&seq[..], &payload]).is_err());
    assert_eq!(decode_seq(&[1, 2]), Err(DecodeError::SeqLen(2)));

    let end = END_SEQ.to_be_bytes();
    for frames in [
        vec![&b""[..], &seq, &payload],
        vec![&seq[..], &payload],
        vec![&b""[..], &b"kv@p@m"[..], &seq, &payload],
        vec![&b"kv@p@m"[..], &seq, &payload],
    ] {
        let ReplayReply::Batch(m) = decode_replay_reply(&frames).unwrap() else {
            panic!("end")
        };
        assert_eq!((m.seq, m.batch.events.len()), (5, 3));
    }
    for frames in [
        vec![&b""[..], &b""[..], &end, &b""[..]],
        vec![&b""[..], &end, &b""[..]],
        vec![&end[..], &b""[..]],
    ] {
        assert_eq!(decode_replay_reply(&frames).unwrap(), ReplayReply::End);
    }
    assert_eq!(
        replay_request(3),
        [Vec::new(), vec![0, 0, 0, 0, 0, 0, 0, 3]]
    );
}
