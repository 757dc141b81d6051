//! The WrapUps service: requesting and reading yearly wrap-ups.

use reelay_contracts::v1;
use reelay_domain::{WrapUpId, validate};
use reelay_kit::ServiceError;
use tonic::Request;

use super::{Reply, WriteApi, ok, request_key};
use crate::convert;

#[tonic::async_trait]
impl v1::wrap_ups_server::WrapUps for WriteApi {
    async fn request_wrap_up(&self, request: Request<v1::RequestWrapUpRequest>) -> Reply<v1::RequestWrapUpResponse> {
        let mut r = request.into_inner();
        let key = request_key("RequestWrapUp", &mut r, |r| &mut r.request_id)?;
        let actor = convert::actor(&r.actor_user_id).map_err(ServiceError::from)?;
        let year = validate::year("year", r.year).map_err(ServiceError::from)?;
        ok(self.store.request_wrap_up(actor, year, key).await?)
    }

    async fn get_wrap_up(&self, request: Request<v1::GetWrapUpRequest>) -> Reply<v1::WrapUp> {
        let id = WrapUpId::parse("wrap_up_id", &request.into_inner().wrap_up_id).map_err(ServiceError::from)?;
        ok(convert::wrap_up(self.store.get_wrap_up(id).await?))
    }
}
