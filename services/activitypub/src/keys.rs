//! Per-user RSA key pairs: generated with `rsa`, used with `ring`.
//!
//! The private key is kept as PKCS#8 DER (what `ring` loads); the public key is published as
//! SubjectPublicKeyInfo PEM, as Mastodon does. Remote keys may also come as PKCS#1 PEM.

use ring::rand::SystemRandom;
use ring::signature::{RSA_PKCS1_2048_8192_SHA256, RSA_PKCS1_SHA256, RsaKeyPair, RsaPublicKeyComponents};
use rsa::pkcs1::DecodeRsaPublicKey;
use rsa::pkcs8::{DecodePublicKey, EncodePrivateKey, EncodePublicKey, LineEnding};
use rsa::traits::PublicKeyParts;

/// Key size of every key Reelay generates (Mastodon's too).
pub const KEY_BITS: usize = 2048;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("cannot generate an RSA key: {0}")]
    Generate(String),
    #[error("not a usable RSA private key: {0}")]
    Private(String),
    #[error("not an RSA public key in PEM: {0}")]
    Public(String),
    #[error("signing failed")]
    Sign,
}

/// A freshly generated key pair.
pub struct GeneratedKey {
    pub private_pkcs8_der: Vec<u8>,
    pub public_key_pem: String,
}

/// Generates a key pair (a prime search: run it off the async threads).
pub fn generate() -> Result<GeneratedKey, KeyError> {
    let key =
        rsa::RsaPrivateKey::new(&mut rsa::rand_core::OsRng, KEY_BITS).map_err(|e| KeyError::Generate(e.to_string()))?;
    let private_pkcs8_der = key.to_pkcs8_der().map_err(|e| KeyError::Generate(e.to_string()))?.as_bytes().to_vec();
    let public_key_pem =
        key.to_public_key().to_public_key_pem(LineEnding::LF).map_err(|e| KeyError::Generate(e.to_string()))?;
    Ok(GeneratedKey { private_pkcs8_der, public_key_pem })
}

/// A private key loaded for signing (RSASSA-PKCS1-v1_5 with SHA-256, constant-time in `ring`).
pub struct SigningKey(RsaKeyPair);

impl SigningKey {
    pub fn from_pkcs8(der: &[u8]) -> Result<Self, KeyError> {
        RsaKeyPair::from_pkcs8(der).map(Self).map_err(|e| KeyError::Private(e.to_string()))
    }

    pub fn sign(&self, message: &[u8]) -> Result<Vec<u8>, KeyError> {
        let mut signature = vec![0; self.0.public().modulus_len()];
        self.0.sign(&RSA_PKCS1_SHA256, &SystemRandom::new(), message, &mut signature).map_err(|_| KeyError::Sign)?;
        Ok(signature)
    }
}

/// A public key read from PEM, for checking signatures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicKey {
    n: Vec<u8>,
    e: Vec<u8>,
}

impl PublicKey {
    /// Reads a SubjectPublicKeyInfo (`BEGIN PUBLIC KEY`) or PKCS#1 (`BEGIN RSA PUBLIC KEY`) PEM.
    pub fn from_pem(pem: &str) -> Result<Self, KeyError> {
        let pem = pem.trim();
        let key = rsa::RsaPublicKey::from_public_key_pem(pem)
            .or_else(|_| rsa::RsaPublicKey::from_pkcs1_pem(pem))
            .map_err(|e| KeyError::Public(e.to_string()))?;
        Ok(Self { n: key.n().to_bytes_be(), e: key.e().to_bytes_be() })
    }

    /// True when `signature` is this key's RSASSA-PKCS1-v1_5 SHA-256 signature of `message`.
    pub fn verify(&self, message: &[u8], signature: &[u8]) -> bool {
        RsaPublicKeyComponents { n: &self.n, e: &self.e }
            .verify(&RSA_PKCS1_2048_8192_SHA256, message, signature)
            .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generated_key_signs_what_its_public_pem_verifies() {
        let key = generate().unwrap();
        assert!(key.public_key_pem.starts_with("-----BEGIN PUBLIC KEY-----"));
        let signer = SigningKey::from_pkcs8(&key.private_pkcs8_der).unwrap();
        let public = PublicKey::from_pem(&key.public_key_pem).unwrap();
        let signature = signer.sign(b"(request-target): post /inbox").unwrap();
        assert_eq!(signature.len(), KEY_BITS / 8);
        assert!(public.verify(b"(request-target): post /inbox", &signature));
        assert!(!public.verify(b"(request-target): post /inbox2", &signature));
        let other = PublicKey::from_pem(&generate().unwrap().public_key_pem).unwrap();
        assert!(!other.verify(b"(request-target): post /inbox", &signature));
        assert!(PublicKey::from_pem("-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----").is_err());
    }
}
