//! `embank cert`: a development certificate authority and the certificates a TLS set-up
//! of `embank serve` needs (server, client), written as PEM files. For tests, demos and
//! private clusters; in production, use your own PKI.

use std::path::{Path, PathBuf};

use clap::Args;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};

#[derive(Args, Debug)]
pub struct CertArgs {
    /// Directory to write ca.pem, server.pem, server.key, client.pem, client.key into.
    #[arg(long, default_value = "embank-tls")]
    pub out: PathBuf,
    /// Names and addresses the server certificate is valid for (repeatable); localhost,
    /// 127.0.0.1 and ::1 are always included.
    #[arg(long = "host")]
    pub hosts: Vec<String>,
    /// Replace files that exist already.
    #[arg(long)]
    pub force: bool,
}

/// The files written by [`write`].
#[derive(Clone, Debug)]
pub struct CertFiles {
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

fn err(what: &str, e: impl std::fmt::Display) -> String {
    format!("{what}: {e}")
}

fn params(cn: &str, sans: Vec<String>) -> Result<CertificateParams, String> {
    let mut p = CertificateParams::new(sans).map_err(|e| err("certificate names", e))?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    dn.push(DnType::OrganizationName, "embank development CA");
    p.distinguished_name = dn;
    Ok(p)
}

/// Writes a new CA and a server and a client certificate signed by it into `out`.
pub fn write(out: &Path, hosts: &[String], force: bool) -> Result<CertFiles, String> {
    std::fs::create_dir_all(out).map_err(|e| err(&format!("cannot create {}", out.display()), e))?;
    let files = CertFiles {
        ca: out.join("ca.pem"),
        server_cert: out.join("server.pem"),
        server_key: out.join("server.key"),
        client_cert: out.join("client.pem"),
        client_key: out.join("client.key"),
    };
    if !force {
        for p in [&files.ca, &files.server_cert, &files.server_key, &files.client_cert, &files.client_key] {
            if p.exists() {
                return Err(format!("{} exists; pass --force to replace it", p.display()));
            }
        }
    }
    let ca_key = KeyPair::generate().map_err(|e| err("CA key", e))?;
    let mut ca = params("embank development CA", Vec::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    let ca_cert = ca.self_signed(&ca_key).map_err(|e| err("CA certificate", e))?;

    let mut names = vec!["localhost".to_string(), "127.0.0.1".to_string(), "::1".to_string()];
    names.extend(hosts.iter().cloned());
    names.dedup();
    let server_key = KeyPair::generate().map_err(|e| err("server key", e))?;
    let mut server = params("embank serve", names)?;
    server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let server_cert = server.signed_by(&server_key, &ca_cert, &ca_key).map_err(|e| err("server certificate", e))?;

    let client_key = KeyPair::generate().map_err(|e| err("client key", e))?;
    let mut client = params("embank client", Vec::new())?;
    client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let client_cert = client.signed_by(&client_key, &ca_cert, &ca_key).map_err(|e| err("client certificate", e))?;

    let write = |p: &Path, text: String, secret: bool| -> Result<(), String> {
        std::fs::write(p, text).map_err(|e| err(&format!("cannot write {}", p.display()), e))?;
        if secret {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o600))
                .map_err(|e| err(&format!("cannot restrict {}", p.display()), e))?;
        }
        Ok(())
    };
    write(&files.ca, ca_cert.pem(), false)?;
    write(&files.server_cert, server_cert.pem(), false)?;
    write(&files.server_key, server_key.serialize_pem(), true)?;
    write(&files.client_cert, client_cert.pem(), false)?;
    write(&files.client_key, client_key.serialize_pem(), true)?;
    Ok(files)
}

pub fn run(args: CertArgs) -> Result<(), String> {
    let f = write(&args.out, &args.hosts, args.force)?;
    println!(
        "wrote {} (the CA clients verify against), {} + {} (for [tls] cert_file/key_file), {} + {} (client certificate, for client_ca_file = {:?})",
        f.ca.display(),
        f.server_cert.display(),
        f.server_key.display(),
        f.client_cert.display(),
        f.client_key.display(),
        f.ca.display()
    );
    Ok(())
}
