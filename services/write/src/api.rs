//! The domain gRPC API: validate the request (naming the bad field), run the command, map the
//! result. No handler here opens a transaction; the store does.

use reelay_contracts::v1::{
    self, federation_server::FederationServer, integrations_server::IntegrationsServer, movies_server::MoviesServer,
    reviews_server::ReviewsServer, social_server::SocialServer, users_server::UsersServer,
    watchlist_server::WatchlistServer, wrap_ups_server::WrapUpsServer,
};
use reelay_domain::{MovieId, ReviewId, UserId, WrapUpId, letterboxd, validate};
use reelay_runtime::{GrpcServer, ServiceError};
use tonic::{Request, Response, Status, Streaming};

use crate::convert;
use crate::store::{RemoteReview, Store};

/// The largest Letterboxd export accepted (the file, summed over its chunks).
pub const MAX_IMPORT_BYTES: usize = 32 * 1024 * 1024;

type Reply<T> = Result<Response<T>, Status>;

fn ok<T>(value: T) -> Reply<T> {
    Ok(Response::new(value))
}

/// Mounts every domain service on `server`, each with the server's message-size limit.
pub fn mount(server: GrpcServer, store: Store) -> GrpcServer {
    let api = WriteApi { store };
    let limit = server.config().max_message_bytes;
    macro_rules! limited {
        ($server:ident) => {
            $server::new(api.clone()).max_decoding_message_size(limit).max_encoding_message_size(limit)
        };
    }
    server
        .add_service(limited!(UsersServer))
        .add_service(limited!(MoviesServer))
        .add_service(limited!(ReviewsServer))
        .add_service(limited!(WatchlistServer))
        .add_service(limited!(WrapUpsServer))
        .add_service(limited!(SocialServer))
        .add_service(limited!(IntegrationsServer))
        .add_service(limited!(FederationServer))
}

#[derive(Clone)]
struct WriteApi {
    store: Store,
}

#[tonic::async_trait]
impl v1::users_server::Users for WriteApi {
    async fn create_user(&self, request: Request<v1::CreateUserRequest>) -> Reply<v1::User> {
        let r = request.into_inner();
        let handle = validate::handle(&r.handle).map_err(ServiceError::from)?;
        let display_name = validate::display_name(&r.display_name).map_err(ServiceError::from)?;
        ok(convert::user(self.store.create_user(handle, display_name).await?))
    }

    async fn get_user(&self, request: Request<v1::GetUserRequest>) -> Reply<v1::User> {
        let id = UserId::parse("user_id", &request.into_inner().user_id).map_err(ServiceError::from)?;
        ok(convert::user(self.store.get_user(id).await?))
    }
}

#[tonic::async_trait]
impl v1::movies_server::Movies for WriteApi {
    async fn discover_movie(&self, request: Request<v1::DiscoverMovieRequest>) -> Reply<v1::DiscoverMovieResponse> {
        let r = request.into_inner();
        let actor = convert::actor(&r.actor_user_id).map_err(ServiceError::from)?;
        let spec = convert::movie_spec(
            "movie",
            Some(v1::MovieRef {
                by: Some(v1::movie_ref::By::TitleYear(v1::TitleYear {
                    title: r.title,
                    year: r.year,
                    external_id: r.external_id,
                })),
            }),
        )
        // The request's fields are flat; name them as the caller sent them.
        .map_err(|e| ServiceError::invalid(e.field.trim_start_matches("movie.title_year."), &e.reason))?;
        let (movie, created) = self.store.discover_movie(actor, spec).await?;
        ok(v1::DiscoverMovieResponse { movie: Some(convert::movie(movie)), created })
    }

    async fn request_enrichment(
        &self,
        request: Request<v1::RequestEnrichmentRequest>,
    ) -> Reply<v1::RequestEnrichmentResponse> {
        let r = request.into_inner();
        let actor = convert::actor(&r.actor_user_id).map_err(ServiceError::from)?;
        let movie = MovieId::parse("movie_id", &r.movie_id).map_err(ServiceError::from)?;
        let event_id = self.store.request_enrichment(actor, movie).await?;
        ok(v1::RequestEnrichmentResponse { event_id: event_id.to_string() })
    }

    async fn get_movie(&self, request: Request<v1::GetMovieRequest>) -> Reply<v1::Movie> {
        let id = MovieId::parse("movie_id", &request.into_inner().movie_id).map_err(ServiceError::from)?;
        ok(convert::movie(self.store.get_movie(id).await?))
    }
}

#[tonic::async_trait]
impl v1::reviews_server::Reviews for WriteApi {
    async fn log_review(&self, request: Request<v1::LogReviewRequest>) -> Reply<v1::LogReviewResponse> {
        let r = request.into_inner();
        let actor = convert::actor(&r.actor_user_id).map_err(ServiceError::from)?;
        let spec = convert::movie_spec("movie", r.movie).map_err(ServiceError::from)?;
        let fields = convert::review_fields(r.rating, &r.body, &r.watched_on, r.rewatch).map_err(ServiceError::from)?;
        let (review, movie_created) = self.store.log_review(actor, spec, fields).await?;
        ok(v1::LogReviewResponse { review: Some(convert::review(review)), movie_created })
    }

    async fn edit_review(&self, request: Request<v1::EditReviewRequest>) -> Reply<v1::Review> {
        let r = request.into_inner();
        let actor = convert::actor(&r.actor_user_id).map_err(ServiceError::from)?;
        let id = ReviewId::parse("review_id", &r.review_id).map_err(ServiceError::from)?;
        let fields = convert::review_fields(r.rating, &r.body, &r.watched_on, r.rewatch).map_err(ServiceError::from)?;
        ok(convert::review(self.store.edit_review(actor, id, fields).await?))
    }

    async fn delete_review(&self, request: Request<v1::DeleteReviewRequest>) -> Reply<v1::DeleteReviewResponse> {
        let r = request.into_inner();
        let actor = convert::actor(&r.actor_user_id).map_err(ServiceError::from)?;
        let id = ReviewId::parse("review_id", &r.review_id).map_err(ServiceError::from)?;
        let movie_deleted = self.store.delete_review(actor, id).await?;
        ok(v1::DeleteReviewResponse { movie_deleted })
    }

    async fn get_review(&self, request: Request<v1::GetReviewRequest>) -> Reply<v1::Review> {
        let id = ReviewId::parse("review_id", &request.into_inner().review_id).map_err(ServiceError::from)?;
        ok(convert::review(self.store.get_review(id).await?))
    }

    async fn list_diary(&self, request: Request<v1::ListDiaryRequest>) -> Reply<v1::ListDiaryResponse> {
        let r = request.into_inner();
        let user = UserId::parse("user_id", &r.user_id).map_err(ServiceError::from)?;
        let size = validate::page_size(r.page_size).map_err(ServiceError::from)?;
        let after =
            convert::page_token(&r.page_token, |t| ReviewId::parse("page_token", t)).map_err(ServiceError::from)?;
        let rows = self.store.list_diary(user, size, after).await?;
        let next_page_token = if rows.len() == size as usize {
            rows.last().map(|r| r.id.clone()).unwrap_or_default()
        } else {
            String::new()
        };
        ok(v1::ListDiaryResponse { reviews: rows.into_iter().map(convert::review).collect(), next_page_token })
    }
}

#[tonic::async_trait]
impl v1::watchlist_server::Watchlist for WriteApi {
    async fn add_to_watchlist(&self, request: Request<v1::AddToWatchlistRequest>) -> Reply<v1::WatchlistEntry> {
        let r = request.into_inner();
        let actor = convert::actor(&r.actor_user_id).map_err(ServiceError::from)?;
        let spec = convert::movie_spec("movie", r.movie).map_err(ServiceError::from)?;
        ok(convert::watchlist_entry(self.store.add_to_watchlist(actor, spec).await?))
    }

    async fn remove_from_watchlist(
        &self,
        request: Request<v1::RemoveFromWatchlistRequest>,
    ) -> Reply<v1::RemoveFromWatchlistResponse> {
        let r = request.into_inner();
        let actor = convert::actor(&r.actor_user_id).map_err(ServiceError::from)?;
        let movie = MovieId::parse("movie_id", &r.movie_id).map_err(ServiceError::from)?;
        let removed = self.store.remove_from_watchlist(actor, movie).await?;
        ok(v1::RemoveFromWatchlistResponse { removed })
    }

    async fn list_watchlist(&self, request: Request<v1::ListWatchlistRequest>) -> Reply<v1::ListWatchlistResponse> {
        let r = request.into_inner();
        let user = UserId::parse("user_id", &r.user_id).map_err(ServiceError::from)?;
        let size = validate::page_size(r.page_size).map_err(ServiceError::from)?;
        let after =
            convert::page_token(&r.page_token, |t| MovieId::parse("page_token", t)).map_err(ServiceError::from)?;
        let rows = self.store.list_watchlist(user, size, after).await?;
        let next_page_token = if rows.len() == size as usize {
            rows.last().map(|r| r.movie_id.clone()).unwrap_or_default()
        } else {
            String::new()
        };
        ok(v1::ListWatchlistResponse {
            entries: rows.into_iter().map(convert::watchlist_entry).collect(),
            next_page_token,
        })
    }
}

#[tonic::async_trait]
impl v1::wrap_ups_server::WrapUps for WriteApi {
    async fn request_wrap_up(&self, request: Request<v1::RequestWrapUpRequest>) -> Reply<v1::RequestWrapUpResponse> {
        let r = request.into_inner();
        let actor = convert::actor(&r.actor_user_id).map_err(ServiceError::from)?;
        let year = validate::year("year", r.year).map_err(ServiceError::from)?;
        let (wrap_up, created) = self.store.request_wrap_up(actor, year).await?;
        ok(v1::RequestWrapUpResponse { wrap_up: Some(convert::wrap_up(wrap_up)), created })
    }

    async fn get_wrap_up(&self, request: Request<v1::GetWrapUpRequest>) -> Reply<v1::WrapUp> {
        let id = WrapUpId::parse("wrap_up_id", &request.into_inner().wrap_up_id).map_err(ServiceError::from)?;
        ok(convert::wrap_up(self.store.get_wrap_up(id).await?))
    }
}

/// A page of account keys → the response, with the next token when the page is full.
fn accounts_page(keys: Vec<String>, size: u32) -> v1::ListAccountsResponse {
    let next_page_token =
        if keys.len() == size as usize { keys.last().cloned().unwrap_or_default() } else { String::new() };
    v1::ListAccountsResponse {
        accounts: keys.iter().map(|k| crate::store::account_from_key(k)).collect(),
        next_page_token,
    }
}

fn account_page_token(token: &str) -> Result<String, ServiceError> {
    if token.is_empty() || token.starts_with("user:") || token.starts_with("actor:") {
        Ok(token.to_owned())
    } else {
        Err(ServiceError::invalid("page_token", "is not a token this service issued"))
    }
}

#[tonic::async_trait]
impl v1::social_server::Social for WriteApi {
    async fn follow(&self, request: Request<v1::FollowRequest>) -> Reply<v1::SocialResponse> {
        let r = request.into_inner();
        let actor = convert::actor(&r.actor_user_id).map_err(ServiceError::from)?;
        let target = convert::target("target", r.target).map_err(ServiceError::from)?;
        ok(v1::SocialResponse { changed: self.store.follow(actor, target).await? })
    }

    async fn unfollow(&self, request: Request<v1::UnfollowRequest>) -> Reply<v1::SocialResponse> {
        let r = request.into_inner();
        let actor = convert::actor(&r.actor_user_id).map_err(ServiceError::from)?;
        let target = convert::target("target", r.target).map_err(ServiceError::from)?;
        ok(v1::SocialResponse { changed: self.store.unfollow(actor, target).await? })
    }

    async fn block(&self, request: Request<v1::BlockRequest>) -> Reply<v1::SocialResponse> {
        let r = request.into_inner();
        let actor = convert::actor(&r.actor_user_id).map_err(ServiceError::from)?;
        let target = convert::target("target", r.target).map_err(ServiceError::from)?;
        ok(v1::SocialResponse { changed: self.store.block(actor, target).await? })
    }

    async fn unblock(&self, request: Request<v1::UnblockRequest>) -> Reply<v1::SocialResponse> {
        let r = request.into_inner();
        let actor = convert::actor(&r.actor_user_id).map_err(ServiceError::from)?;
        let target = convert::target("target", r.target).map_err(ServiceError::from)?;
        ok(v1::SocialResponse { changed: self.store.unblock(actor, target).await? })
    }

    async fn list_followers(&self, request: Request<v1::ListFollowersRequest>) -> Reply<v1::ListAccountsResponse> {
        let r = request.into_inner();
        let user = UserId::parse("user_id", &r.user_id).map_err(ServiceError::from)?;
        let size = validate::page_size(r.page_size).map_err(ServiceError::from)?;
        let after = account_page_token(&r.page_token)?;
        ok(accounts_page(self.store.list_followers(user, size, &after).await?, size))
    }

    async fn list_following(&self, request: Request<v1::ListFollowingRequest>) -> Reply<v1::ListAccountsResponse> {
        let r = request.into_inner();
        let user = UserId::parse("user_id", &r.user_id).map_err(ServiceError::from)?;
        let size = validate::page_size(r.page_size).map_err(ServiceError::from)?;
        let after = account_page_token(&r.page_token)?;
        ok(accounts_page(self.store.list_following(user, size, &after).await?, size))
    }
}

#[tonic::async_trait]
impl v1::integrations_server::Integrations for WriteApi {
    async fn import_diary(&self, request: Request<Streaming<v1::ImportDiaryChunk>>) -> Reply<v1::ImportDiaryResponse> {
        let mut stream = request.into_inner();
        let mut actor = None;
        let mut data = Vec::new();
        while let Some(chunk) = stream.message().await? {
            if actor.is_none() {
                actor = Some(convert::actor(&chunk.actor_user_id).map_err(ServiceError::from)?);
            }
            if data.len() + chunk.data.len() > MAX_IMPORT_BYTES {
                return Err(ServiceError::invalid(
                    "data",
                    format!("the export is larger than {MAX_IMPORT_BYTES} bytes"),
                )
                .into());
            }
            data.extend_from_slice(&chunk.data);
        }
        let actor =
            actor.ok_or_else(|| ServiceError::invalid("actor_user_id", "is required (the stream was empty)"))?;
        if data.is_empty() {
            return Err(ServiceError::invalid("data", "is required (the export was empty)").into());
        }
        // Validate the whole file before writing anything.
        let rows = tokio::task::spawn_blocking(move || letterboxd::parse(&data))
            .await
            .map_err(|_| ServiceError::internal("the CSV parser failed unexpectedly"))?
            .map_err(ServiceError::from)?;
        if !self.store.user_exists(actor).await? {
            return Err(ServiceError::not_found(format_args!("user {actor}")).into());
        }
        let import_id = uuid::Uuid::now_v7().to_string();
        let summary = self.store.import_diary(actor, import_id.clone(), rows).await?;
        tracing::info!(%import_id, user = %actor, rows = summary.rows, imported = summary.imported,
            skipped = summary.skipped_duplicates, "diary imported");
        ok(v1::ImportDiaryResponse {
            import_id,
            rows: summary.rows,
            imported: summary.imported,
            skipped_duplicates: summary.skipped_duplicates,
            movies_discovered: summary.movies_discovered,
        })
    }
}

#[tonic::async_trait]
impl v1::federation_server::Federation for WriteApi {
    async fn save_remote_review(
        &self,
        request: Request<v1::SaveRemoteReviewRequest>,
    ) -> Reply<v1::SaveRemoteReviewResponse> {
        let r = request.into_inner();
        let review = RemoteReview {
            object_uri: validate::uri("object_uri", &r.object_uri).map_err(ServiceError::from)?,
            actor_uri: validate::uri("actor_uri", &r.actor_uri).map_err(ServiceError::from)?,
            movie: convert::movie_spec("movie", r.movie).map_err(ServiceError::from)?,
            rating: validate::rating("rating", r.rating).map_err(ServiceError::from)?,
            body: validate::body("body", &r.body).map_err(ServiceError::from)?,
            published_at_ms: if r.published_at_ms < 0 {
                return Err(ServiceError::invalid("published_at_ms", "must not be negative").into());
            } else {
                r.published_at_ms
            },
        };
        let saved = self.store.save_remote_review(review).await?;
        ok(v1::SaveRemoteReviewResponse { remote_review_id: saved.id, created: saved.created, changed: saved.changed })
    }

    async fn receive_follow(&self, request: Request<v1::ReceiveFollowRequest>) -> Reply<v1::FederationResponse> {
        let r = request.into_inner();
        let actor_uri = validate::uri("actor_uri", &r.actor_uri).map_err(ServiceError::from)?;
        let user = UserId::parse("user_id", &r.user_id).map_err(ServiceError::from)?;
        let activity_uri = validate::uri("activity_uri", &r.activity_uri).map_err(ServiceError::from)?;
        ok(v1::FederationResponse { changed: self.store.receive_follow(actor_uri, user, activity_uri).await? })
    }

    async fn receive_undo(&self, request: Request<v1::ReceiveUndoRequest>) -> Reply<v1::FederationResponse> {
        let r = request.into_inner();
        let actor_uri = validate::uri("actor_uri", &r.actor_uri).map_err(ServiceError::from)?;
        let user = UserId::parse("user_id", &r.user_id).map_err(ServiceError::from)?;
        let activity_uri = validate::uri("activity_uri", &r.activity_uri).map_err(ServiceError::from)?;
        ok(v1::FederationResponse { changed: self.store.receive_undo(actor_uri, user, activity_uri).await? })
    }
}
