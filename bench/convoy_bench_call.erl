%% @doc The `local_call' variant's send: `!' behind one call to a function of
%% another module, and nothing else. What calling any library's send function
%% costs over writing `!' in place, measured beside `local' and convoy in the
%% `local' scenario, where a send takes about 100 ns (see bench/RESULTS.md,
%% "Where convoy loses").
-module(convoy_bench_call).

-export([send/2]).

%% @doc `Dest ! Msg', returning `ok' as `convoy:send/2' does.
-spec send(pid() | atom() | {atom(), node()}, term()) -> ok.
send(Dest, Msg) ->
    erlang:send(Dest, Msg),
    ok.
