//! Region tokens: the keyed hash that proves a handle was issued by this pool
//! manager to this owner.
//!
//! `token = BLAKE3-keyed(secret, DOMAIN ‖ region ‖ pool ‖ offset ‖ len ‖
//! directory ‖ instance)`, all integers little-endian, 256 bits. Because
//! region ids are never reused and a region's fields never change, a valid
//! token names exactly one allocation, forever: a token for a region that no
//! longer exists proves the region was freed (useful to answer a retried free),
//! and a token cannot be moved to another region or owner.
//!
//! Tokens prove ownership on control-plane operations (free, reattach). They
//! do not gate mapping: device permissions and descriptor passing do.
//!
//! The secret is 32 random bytes kept in a 0600 file by the store; the state
//! machine only ever sees a [`Secret`] value. Its `Debug` never prints it.

use std::fmt;

use super::types::{Handle, ManagerId, OwnerLabel, PoolId, RegionId, Token};

/// Size of the server secret in bytes (the BLAKE3 key size).
pub const SECRET_BYTES: usize = blake3::KEY_LEN;

/// Domain separation: a token can never collide with another use of the key.
const TOKEN_DOMAIN: &[u8; 24] = b"cxlkv pool token v1\0\0\0\0\0";
/// Domain of the manager id derived from the same key.
const MANAGER_ID_DOMAIN: &[u8; 24] = b"cxlkv pool manager id v1";

const TOKEN_INPUT_BYTES: usize = TOKEN_DOMAIN.len() + 8 + 4 + 8 + 8 + 8 + 8;

/// The pool manager's token key.
#[derive(Clone)]
pub struct Secret([u8; SECRET_BYTES]);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl Secret {
    pub fn from_bytes(bytes: [u8; SECRET_BYTES]) -> Self {
        Self(bytes)
    }

    /// The token for a region with these fields.
    pub fn token(
        &self,
        region: RegionId,
        pool: PoolId,
        offset_bytes: u64,
        len_bytes: u64,
        owner: OwnerLabel,
    ) -> Token {
        let mut input = [0u8; TOKEN_INPUT_BYTES];
        let mut at = 0;
        let mut put = |bytes: &[u8]| {
            input[at..at + bytes.len()].copy_from_slice(bytes);
            at += bytes.len();
        };
        put(TOKEN_DOMAIN);
        put(&region.0.to_le_bytes());
        put(&pool.0.to_le_bytes());
        put(&offset_bytes.to_le_bytes());
        put(&len_bytes.to_le_bytes());
        put(&owner.directory.0.to_le_bytes());
        put(&owner.instance.0.to_le_bytes());
        Token(*blake3::keyed_hash(&self.0, &input).as_bytes())
    }

    /// True when `handle.token` is the token of the handle's own fields.
    /// Constant time in the token bytes (`blake3::Hash`'s equality).
    pub fn verify(&self, handle: &Handle) -> bool {
        let expected = self.token(
            handle.region,
            handle.pool,
            handle.offset_bytes,
            handle.len_bytes,
            handle.owner,
        );
        blake3::Hash::from_bytes(expected.0) == handle.token.0
    }

    /// A stable 128-bit name for the manager that owns this secret, written
    /// into the lease slots of pool headers. It is the same across restarts of
    /// the same state directory (so a restarted manager may renew its own
    /// lease at once) and different for every other state directory.
    pub fn manager_id(&self) -> ManagerId {
        let h = blake3::keyed_hash(&self.0, MANAGER_ID_DOMAIN);
        let mut id = [0u8; 16];
        id.copy_from_slice(&h.as_bytes()[..16]);
        ManagerId(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::types::{DirectoryId, InstanceId, TOKEN_BYTES};

    fn owner(d: u64, i: u64) -> OwnerLabel {
        OwnerLabel {
            directory: DirectoryId(d),
            instance: InstanceId(i),
        }
    }

    fn handle(s: &Secret) -> Handle {
        let (region, pool, offset_bytes, len_bytes, owner) =
            (RegionId(7), PoolId(1), 4 << 20, 2 << 20, owner(3, 4));
        Handle {
            region,
            pool,
            offset_bytes,
            len_bytes,
            owner,
            token: s.token(region, pool, offset_bytes, len_bytes, owner),
        }
    }

    #[test]
    fn a_token_verifies_only_with_its_own_fields() {
        let s = Secret::from_bytes([9; SECRET_BYTES]);
        let h = handle(&s);
        assert!(s.verify(&h));
        let variants = [
            Handle {
                region: RegionId(8),
                ..h
            },
            Handle {
                pool: PoolId(2),
                ..h
            },
            Handle {
                offset_bytes: h.offset_bytes + 4096,
                ..h
            },
            Handle {
                len_bytes: h.len_bytes * 2,
                ..h
            },
            Handle {
                owner: owner(4, 4),
                ..h
            },
            Handle {
                owner: owner(3, 5),
                ..h
            },
        ];
        for v in variants {
            assert!(
                !s.verify(&v),
                "{v:?} must not verify with the original token"
            );
        }
    }

    #[test]
    fn a_token_does_not_verify_under_another_secret() {
        let a = Secret::from_bytes([1; SECRET_BYTES]);
        let b = Secret::from_bytes([2; SECRET_BYTES]);
        assert!(!b.verify(&handle(&a)));
        assert_ne!(a.manager_id(), b.manager_id());
    }

    #[test]
    fn every_token_bit_matters() {
        let s = Secret::from_bytes([5; SECRET_BYTES]);
        let h = handle(&s);
        for bit in 0..TOKEN_BYTES * 8 {
            let mut t = h.token;
            t.0[bit / 8] ^= 1 << (bit % 8);
            assert!(!s.verify(&Handle { token: t, ..h }), "bit {bit}");
        }
    }

    #[test]
    fn secret_debug_is_redacted() {
        let s = Secret::from_bytes([0x41; SECRET_BYTES]);
        assert_eq!(format!("{s:?}"), "Secret(<redacted>)");
    }
}
