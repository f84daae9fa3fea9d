//! What the tests over TLS need: a connector (rustls) that takes the test server's
//! self-signed certificate, the URL that requires TLS, and a store whose every
//! connection uses it.

use std::sync::Arc;

use tower_idempotency::store::PostgresStore;

use crate::common::{TestSchema, database_url};

/// Takes the server's certificate whoever signed it and whatever name it carries (the
/// test server's is self-signed, made for its host name), and checks the handshake's
/// signatures against it as usual.
#[derive(Debug)]
struct AnyCertificate(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// A TLS connector (rustls) that takes the test server's self-signed certificate.
pub(crate) fn tls() -> tokio_postgres_rustls::MakeRustlsConnect {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
        .with_no_client_auth();
    tokio_postgres_rustls::MakeRustlsConnect::new(config)
}

/// `DATABASE_URL` requiring TLS, its connections named `application_name`. The server
/// must offer TLS (Debian's package turns it on, with a self-signed certificate).
pub(crate) fn tls_url(application_name: &str) -> String {
    let url = database_url();
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}sslmode=require&application_name={application_name}")
}

/// A migrated store whose every connection uses TLS (`connect_with_tls`), named
/// after the schema (`application_name`), so that `pg_stat_ssl` can tell them.
pub(crate) async fn store_over_tls(schema: &TestSchema) -> PostgresStore {
    let ssl: String = schema.query("SHOW ssl").await[0].get(0);
    assert_eq!(
        ssl, "on",
        "the TLS tests need a PostgreSQL that offers TLS (ssl = on; Debian's package \
         turns it on, with a self-signed certificate)"
    );
    let store = PostgresStore::connect_with_tls(&tls_url(&schema.name), tls())
        .expect("store")
        .with_schema_name(&schema.name)
        .expect("schema name");
    store.migrate().await.expect("migrate over TLS");
    store
}

/// The connections of [`store_over_tls`] stores open now: (how many, how many of
/// them encrypted, how many of them the `LISTEN` connection's).
pub(crate) async fn tls_connections(schema: &TestSchema) -> (i64, i64, i64) {
    let row = &schema
        .query(&format!(
            "SELECT count(*), count(*) FILTER (WHERE s.ssl),
                    count(*) FILTER (WHERE a.query LIKE 'LISTEN%' OR a.query LIKE 'NOTIFY%')
             FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
             WHERE a.application_name = '{}'",
            schema.name
        ))
        .await[0];
    (row.get(0), row.get(1), row.get(2))
}
