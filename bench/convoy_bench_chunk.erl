%% What a message in pieces costs its receiver beyond a plain send: joining the
%% pieces (`iolist_to_binary/1') and, for a term that is not a binary, decoding it
%% (`binary_to_term/1'), for the seed's 10 MB message `{Pid, Binary}' cut into
%% pieces of 64 KiB (convoy's defaults). Fastest of 10, microseconds, in this
%% process. Run on its own:
%%
%%   erl -noshell -pa _build/bench/lib/convoy/ebin -pa _build/bench/lib/convoy/bench \
%%       -eval 'convoy_bench_chunk:copies(), halt().'
-module(convoy_bench_chunk).

-export([copies/0]).

-spec copies() -> ok.
copies() ->
    Msg = {self(), binary:copy(<<"b">>, 10000000)},
    {term, Io} = convoy_chunk:payload(Msg),
    {_, Pieces0} = convoy_chunk:pieces(Io, 65536),
    %% as they arrive: binaries of their own, not parts of the sender's
    Pieces = [binary:copy(P) || P <- Pieces0],
    Whole = iolist_to_binary(Pieces),
    Rows = [{"cut (term_to_iovec + pieces/2)",
             fun() -> convoy_chunk:pieces(erlang:term_to_iovec(Msg), 65536) end},
            {"join (iolist_to_binary/1)", fun() -> iolist_to_binary(Pieces) end},
            {"decode (binary_to_term/1)", fun() -> binary_to_term(Whole) end}],
    io:format("10 MB {Pid, Binary} in ~b pieces of 64 KiB:~n", [length(Pieces)]),
    lists:foreach(fun({Label, F}) ->
                          Us = lists:min([element(1, timer:tc(F)) || _ <- lists:seq(1, 10)]),
                          io:format("  ~-32s ~8b us~n", [Label, Us])
                  end, Rows).
