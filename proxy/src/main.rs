//! The `kvmesh-proxy` binary: everything lives in the library's `cli` module.

fn main() -> std::process::ExitCode {
    kvmesh_proxy::cli::main()
}
