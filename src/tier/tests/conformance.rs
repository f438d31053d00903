//! The reference's shared conformance suite (§7.1, all 15 cases), against
//! the real directory. "write" = `reserve_write(new, retained)` then
//! `finish_write`, both all `Success`.

use super::*;

const ONE: Holds = Holds::ONE;

#[test]
fn conformance_1_reserve_read_of_a_never_written_key_is_key_not_exist() {
    let h = harness("conf1");
    let k = key(1);
    let r = h.reserve_read(&[&k], ONE);
    assert_eq!(r[0].code, TierCode::KeyNotExist);
    assert!(r[0].page.is_none());
    h.healthy();
}

#[test]
fn conformance_2_round_trip_write_reserve_unsafe_read_finish() {
    let h = harness("conf2");
    let k = key(2);
    h.write(&[&k]);
    let r = h.reserve_read(&[&k], ONE);
    assert_eq!(r[0].code, TierCode::Success);
    let p = page(&r[0]);
    assert_eq!(
        read_bytes(&p),
        bytes_for(&k, CHUNK),
        "the written bytes, in place"
    );
    let u = h.unsafe_read(&[&k]);
    assert_eq!(u[0].code, TierCode::Success);
    assert!(
        page(&u[0]).same_page(&p),
        "unsafe_read serves the same page"
    );
    assert_eq!(h.finish_read(&[&k], ONE), vec![TierCode::Success]);
    h.healthy();
}

#[test]
fn conformance_3_second_reserve_write_of_an_in_flight_key_is_not_writable() {
    let h = harness("conf3");
    let k = key(3);
    assert_eq!(h.reserve(&[&k], false)[0].code, TierCode::Success);
    let again = h.reserve(&[&k], false);
    assert_eq!(again[0].code, TierCode::KeyNotWritable);
    assert!(again[0].page.is_none());
    h.healthy();
}

#[test]
fn conformance_4_unsafe_read_of_a_written_key_without_reserve_is_not_success() {
    let h = harness("conf4");
    let k = key(4);
    h.write(&[&k]);
    assert_ne!(h.unsafe_read(&[&k])[0].code, TierCode::Success);
}

#[test]
fn conformance_5_delete_is_locked_while_read_held_and_succeeds_after_finish() {
    let h = harness("conf5");
    let k = key(5);
    h.write(&[&k]);
    assert_eq!(h.reserve_read(&[&k], ONE)[0].code, TierCode::Success);
    assert_eq!(h.delete(&[&k]), vec![TierCode::KeyIsLocked]);
    assert_eq!(h.finish_read(&[&k], ONE), vec![TierCode::Success]);
    assert_eq!(h.delete(&[&k]), vec![TierCode::Success]);
    assert!(!h.in_directory(&k));
    h.healthy();
}

#[test]
fn conformance_6_extra_count_two_takes_three_finishes_before_delete() {
    let h = harness("conf6");
    let k = key(6);
    h.write(&[&k]);
    let r = h.reserve_read(&[&k], Holds::from_extra_count(2));
    assert_eq!(r[0].code, TierCode::Success);
    assert_eq!(h.delete(&[&k]), vec![TierCode::KeyIsLocked]);
    for _ in 0..3 {
        assert_eq!(h.finish_read(&[&k], ONE), vec![TierCode::Success]);
    }
    assert_eq!(h.delete(&[&k]), vec![TierCode::Success]);
    h.healthy();
}

#[test]
fn conformance_7_non_force_clear_keeps_a_held_read() {
    let h = harness("conf7");
    let k = key(7);
    h.write(&[&k]);
    let r = h.reserve_read(&[&k], ONE);
    h.tier.clear(false).unwrap();
    let u = h.unsafe_read(&[&k]);
    assert_eq!(u[0].code, TierCode::Success);
    assert!(page(&u[0]).same_page(&page(&r[0])));
    assert_eq!(h.finish_read(&[&k], ONE), vec![TierCode::Success]);
    h.healthy();
}

#[test]
fn conformance_8_evictable_after_write_not_while_held_again_after_finish() {
    let h = harness("conf8");
    let k = key(8);
    h.write(&[&k]);
    assert!(h.tier.is_key_evictable(&k));
    h.reserve_read(&[&k], ONE);
    assert!(!h.tier.is_key_evictable(&k));
    h.finish_read(&[&k], ONE);
    assert!(h.tier.is_key_evictable(&k));
}

#[test]
fn conformance_9_retained_promote_holds_the_key_until_finish_read() {
    let h = harness("conf9");
    let k = key(9);
    assert_eq!(h.reserve(&[&k], false)[0].code, TierCode::Success);
    assert_eq!(h.promote(&[&k], ONE)[0].code, TierCode::Success);
    assert_eq!(h.unsafe_read(&[&k])[0].code, TierCode::Success);
    assert_eq!(h.delete(&[&k]), vec![TierCode::KeyIsLocked]);
    assert_eq!(h.finish_read(&[&k], ONE), vec![TierCode::Success]);
    assert_eq!(h.delete(&[&k]), vec![TierCode::Success]);
    h.healthy();
}

#[test]
fn conformance_10_temporary_promote_is_gone_after_its_finish_read() {
    let h = harness("conf10");
    let k = key(10);
    assert_eq!(h.reserve(&[&k], true)[0].code, TierCode::Success);
    assert_eq!(h.promote(&[&k], ONE)[0].code, TierCode::Success);
    assert_eq!(h.unsafe_read(&[&k])[0].code, TierCode::Success);
    assert_eq!(h.finish_read(&[&k], ONE), vec![TierCode::Success]);
    let u = h.unsafe_read(&[&k]);
    assert_eq!(u[0].code, TierCode::KeyNotExist);
    assert!(u[0].page.is_none());
    h.healthy();
}

#[test]
fn conformance_11_promote_fires_its_callback_and_never_write_finished() {
    let h = harness("conf11");
    let k = key(11);
    h.reserve(&[&k], false);
    h.listen();
    assert_eq!(h.promote(&[&k], ONE)[0].code, TierCode::Success);
    assert_eq!(
        h.rec.kinds("finish_write_and_reserve_read"),
        vec![vec![k.clone()]]
    );
    assert!(h.rec.kinds("write_finished").is_empty());
}

#[test]
fn conformance_12_reserve_read_of_a_write_reserved_key_is_not_readable() {
    let h = harness("conf12");
    let k = key(12);
    h.reserve(&[&k], false);
    let r = h.reserve_read(&[&k], ONE);
    assert_eq!(r[0].code, TierCode::KeyNotReadable);
    assert!(r[0].page.is_none());
}

#[test]
fn conformance_13_finishes_of_never_reserved_keys_are_key_not_exist() {
    let h = harness("conf13");
    let k = key(13);
    assert_eq!(h.finish_read(&[&k], ONE), vec![TierCode::KeyNotExist]);
    assert_eq!(
        h.tier.finish_write(&[&k]).unwrap(),
        vec![TierCode::KeyNotExist]
    );
}

#[test]
fn conformance_14_delete_of_a_missing_key_is_key_not_exist() {
    let h = harness("conf14");
    assert_eq!(h.delete(&[&key(14)]), vec![TierCode::KeyNotExist]);
}

#[test]
fn conformance_15_listener_lifecycle() {
    let h = harness("conf15");
    h.listen();
    let k = key(15);
    let ks = vec![k.clone()];
    h.reserve(&[&k], false);
    assert_eq!(h.rec.kinds("reserved_write"), vec![ks.clone()]);
    h.tier.finish_write(&[&k]).unwrap();
    assert_eq!(h.rec.kinds("write_finished"), vec![ks.clone()]);
    h.reserve_read(&[&k], ONE);
    assert_eq!(h.rec.kinds("reserved_read"), vec![ks.clone()]);
    h.tier.touch_keys(&[&k]).unwrap();
    assert_eq!(h.rec.kinds("accessed"), vec![ks.clone()]);
    h.finish_read(&[&k], ONE);
    assert_eq!(h.rec.kinds("read_finished"), vec![ks.clone()]);
    assert_eq!(h.delete(&[&k]), vec![TierCode::Success]);
    assert_eq!(
        h.rec.kinds("deleted").last().cloned(),
        Some(ks),
        "the delete reports the key removed"
    );
}
