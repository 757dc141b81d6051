//! Local users' key pairs: generated off the async threads and outside the single writer, and
//! loaded once for signing. A private key leaves this module only as a signature.
//!
//! Every user gets a key pair when it is created. Users from before keys existed get theirs at
//! start-up ([`generate_missing_keys`]), and any user still without one when it is first needed
//! gets it then: one path, [`ActorKeys::ensure`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use reelay_activitypub::keys::{self, GeneratedKey, SigningKey};
use reelay_domain::UserId;
use reelay_kit::{ServiceError, Shutdown};

use crate::WriteError;
use crate::store::Store;

/// Loaded signing keys kept; past this the cache starts over (loading one costs about a
/// millisecond).
const CACHED_SIGNERS: usize = 4096;

/// Generates a key pair on the blocking pool.
pub async fn generate() -> Result<GeneratedKey, ServiceError> {
    tokio::task::spawn_blocking(keys::generate)
        .await
        .map_err(|e| ServiceError::internal(format!("key generation stopped: {e}")))?
        .map_err(|e| ServiceError::internal(e.to_string()))
}

#[derive(Clone)]
pub struct ActorKeys {
    store: Store,
    signers: Arc<Mutex<HashMap<UserId, Arc<SigningKey>>>>,
}

impl ActorKeys {
    pub fn new(store: Store) -> Self {
        Self { store, signers: Arc::default() }
    }

    /// Makes sure `user` has a key pair, generating it if it has none.
    pub async fn ensure(&self, user: UserId) -> Result<(), WriteError> {
        if self.store.private_key(user).await?.is_none() {
            self.store.save_actor_key(user, generate().await?).await?;
        }
        Ok(())
    }

    /// Signs `message` with `user`'s private key (RSASSA-PKCS1-v1_5, SHA-256).
    pub async fn sign(&self, user: UserId, message: &[u8]) -> Result<Vec<u8>, WriteError> {
        let cached = self.signers.lock().expect("signer cache lock").get(&user).cloned();
        let signer = match cached {
            Some(signer) => signer,
            None => {
                self.ensure(user).await?;
                let der = self
                    .store
                    .private_key(user)
                    .await?
                    .ok_or_else(|| ServiceError::not_found(format_args!("user {user}")))?;
                let signer = Arc::new(SigningKey::from_pkcs8(&der).map_err(|e| ServiceError::internal(e.to_string()))?);
                let mut signers = self.signers.lock().expect("signer cache lock");
                if signers.len() >= CACHED_SIGNERS {
                    signers.clear();
                }
                signers.insert(user, signer.clone());
                signer
            }
        };
        Ok(signer.sign(message).map_err(|e| ServiceError::internal(e.to_string()))?)
    }
}

/// Gives every user without a key pair one (users created before migration 0110), in the
/// background after start-up.
pub async fn generate_missing_keys(store: Store, shutdown: Shutdown) {
    let keys = ActorKeys::new(store.clone());
    let mut generated = 0usize;
    while !shutdown.is_requested() {
        let users = match store.users_without_key(100).await {
            Ok(users) if users.is_empty() => break,
            Ok(users) => users,
            Err(error) => {
                tracing::warn!(%error, "cannot list the users without a key pair; trying again later");
                tokio::time::sleep(std::time::Duration::from_secs(5)).await;
                continue;
            }
        };
        for user in users {
            if shutdown.is_requested() {
                break;
            }
            match keys.ensure(user).await {
                Ok(()) => generated += 1,
                Err(error) => {
                    tracing::warn!(%error, user_id = %user, "cannot generate a key pair; trying again later");
                    tokio::time::sleep(std::time::Duration::from_secs(5)).await;
                }
            }
        }
    }
    if generated > 0 {
        tracing::info!(users = generated, "generated key pairs for users created before keys existed");
    }
}
