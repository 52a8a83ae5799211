/// glibc's malloc cost 1.08-1.14x the CPU per message of jemalloc; mimalloc does as well as
/// jemalloc at the same peak RSS (its transparent huge pages off: they held 9 MiB more), and
/// builds in 7 CPU seconds where jemalloc took 143 (BENCHMARKS.md "Build and test time").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    sluice::cli::main()
}
