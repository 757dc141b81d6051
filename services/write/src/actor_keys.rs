//! Local users' key pairs: generated off the async threads and outside the single writer, and
//! loaded once for signing. A private key leaves this module only as a signature.
//!
//! Every user gets a key pair right after it is created, from a background task that creating
//! a user wakes ([`ActorKeys::generate_missing`]): a 2048-bit prime search takes a tenth of a
//! second or more, which `CreateUser` should not wait for. The same task gives users from
//! before keys existed theirs at start-up, and a user still without one when it is first needed
//! (its actor fetched, a request signed) gets it then: one path, [`ActorKeys::ensure`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reelay_activitypub::keys::{self, GeneratedKey, SigningKey};
use reelay_domain::UserId;
use reelay_kit::{ServiceError, Shutdown};
use tokio::sync::Notify;

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
    created: Arc<Notify>,
}

impl ActorKeys {
    pub fn new(store: Store) -> Self {
        Self { store, signers: Arc::default(), created: Arc::default() }
    }

    /// A user was created: its key pair is due.
    pub fn user_created(&self) {
        self.created.notify_one();
    }

    /// Makes sure `user` has a key pair, generating it if it has none; NOT_FOUND for a user
    /// that does not exist, checked before the prime search (anyone can ask for the actor of
    /// any id, and each search costs a tenth of a second of CPU or more).
    pub async fn ensure(&self, user: UserId) -> Result<(), WriteError> {
        if self.store.private_key(user).await?.is_none() {
            if !self.store.user_exists(user).await? {
                return Err(ServiceError::not_found(format_args!("user {user}")).into());
            }
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

impl ActorKeys {
    /// Gives every user without a key pair one, at start-up and whenever users were created,
    /// until shutdown.
    pub async fn generate_missing(self, shutdown: Shutdown) {
        while !shutdown.is_requested() {
            let users = match self.store.users_without_key(100).await {
                Ok(users) => users,
                Err(error) => {
                    tracing::warn!(%error, "cannot list the users without a key pair; trying again later");
                    Vec::new()
                }
            };
            for user in &users {
                if shutdown.is_requested() {
                    return;
                }
                if let Err(error) = self.ensure(*user).await {
                    tracing::warn!(%error, user_id = %user, "cannot generate a key pair; trying again later");
                    break;
                }
            }
            if users.len() == 100 {
                continue;
            }
            tokio::select! {
                () = self.created.notified() => {}
                () = shutdown.requested() => return,
                // Failures above are retried at this pace.
                () = tokio::time::sleep(Duration::from_secs(30)) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use reelay_kit::ErrorCode;
    use reelay_outbox::{Database, DbConfig};

    use super::*;

    /// A user that does not exist gets no key pair searched for (anyone can ask for the actor of
    /// any id): NOT_FOUND; one that exists gets its key pair, once.
    #[tokio::test]
    async fn only_users_that_exist_get_a_key_pair() {
        let dir = tempfile::tempdir().unwrap();
        let db = Database::open(&DbConfig::new(dir.path().join("reelay.db"))).await.unwrap();
        let store = Store::new(db);
        let keys = ActorKeys::new(store.clone());
        match keys.ensure(UserId::new()).await {
            Err(WriteError::Service(error)) => assert_eq!(error.code, ErrorCode::NotFound, "{error}"),
            other => panic!("an unknown user: {other:?}"),
        }
        let user = store.create_user("ana".into(), "Ana".into(), None).await.unwrap();
        let user = UserId::parse("user_id", &user.user_id).unwrap();
        keys.ensure(user).await.unwrap();
        let key = store.private_key(user).await.unwrap().expect("the user's key pair");
        keys.ensure(user).await.unwrap();
        assert_eq!(store.private_key(user).await.unwrap(), Some(key), "kept, not made again");
    }
}
