/// glibc's allocator cost about a tenth of the runner's CPU in the drain benchmark (many small,
/// short-lived allocations across threads); mimalloc is built for that.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    sluice::cli::main()
}
