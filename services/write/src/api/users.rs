//! The Users service: registering and reading users.

use reelay_contracts::v1;
use reelay_domain::{UserId, validate};
use reelay_kit::ServiceError;
use tonic::Request;

use super::{Reply, WriteApi, ok, request_key};
use crate::convert;

#[tonic::async_trait]
impl v1::users_server::Users for WriteApi {
    async fn create_user(&self, request: Request<v1::CreateUserRequest>) -> Reply<v1::User> {
        let mut r = request.into_inner();
        let key = request_key("CreateUser", &mut r, |r| &mut r.request_id)?;
        let handle = validate::handle(&r.handle).map_err(ServiceError::from)?;
        let display_name = validate::display_name(&r.display_name).map_err(ServiceError::from)?;
        let user = self.store.create_user(handle, display_name, key).await?;
        self.keys.user_created();
        ok(user)
    }

    async fn get_user(&self, request: Request<v1::GetUserRequest>) -> Reply<v1::User> {
        let id = UserId::parse("user_id", &request.into_inner().user_id).map_err(ServiceError::from)?;
        ok(convert::user(self.store.get_user(id).await?))
    }
}
