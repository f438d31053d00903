//! The `cxlkv` command line; see `cxlkv --help`.

fn main() -> std::process::ExitCode {
    cxlkv::cli::main()
}
