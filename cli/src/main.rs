//! The `kvmesh` binary: everything lives in the library's `cli` module.

fn main() -> std::process::ExitCode {
    kvmesh::cli::main()
}
