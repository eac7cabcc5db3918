%% What a message in pieces costs its receiver beyond a plain send: joining the
%% pieces (`iolist_to_binary/1') and, for a term that is not a binary, decoding it
%% (`binary_to_term/1'), for the seed's 10 MB message `{Pid, Binary}' cut into
%% pieces of 64 KiB (convoy's defaults). Fastest of 10, microseconds, in this
%% process. Run on its own:
%%
%%   erl -noshell -pa _build/bench/lib/convoy/ebin -pa _build/bench/lib/convoy/bench \
%%       -eval 'convoy_bench_chunk:copies(), halt().'
%%
%% `timeline/0' follows one such message between two nodes (a peer node it
%% starts, convoy on both with `chunk_guard => always'): the seed's message sent
%% by `!' and answered, the same by `convoy:send/2' in pieces, and, from a trace
%% of the sender (so a little slower), when its first piece was acknowledged, its
%% last, and when the receiver's inbox had joined, decoded and delivered it.
%% Medians of 5 messages after 20 for warm-up, microseconds:
%%
%%   erl -noshell -sname chunk_timeline -pa _build/bench/lib/convoy/ebin \
%%       -pa _build/bench/lib/convoy/bench -eval 'convoy_bench_chunk:timeline(), halt().'
-module(convoy_bench_chunk).

-export([copies/0, timeline/0, sink/0]).

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

-spec timeline() -> ok.
timeline() ->
    Paths = ["-pa", filename:dirname(code:which(convoy)),
             "-pa", filename:dirname(code:which(?MODULE))],
    {ok, Peer, Node} = peer:start_link(#{name => peer:random_name(chunk_timeline),
                                         args => Paths}),
    Env = [{chunk_guard, always}],
    [ok = erpc:call(N, application, set_env, [convoy, K, V]) || N <- [node(), Node], {K, V} <- Env],
    [{ok, _} = erpc:call(N, application, ensure_all_started, [convoy]) || N <- [node(), Node]],
    Sink = spawn(Node, ?MODULE, sink, []),
    Msg = {self(), binary:copy(<<"b">>, 10000000)},
    Plain = fun() -> Sink ! Msg, receive true -> ok end end,
    Pieces = fun() -> convoy:send(Sink, Msg), receive true -> ok end end,
    [F() || _ <- lists:seq(1, 20), F <- [Plain, Pieces]],
    Rows = [{us(Plain), us(Pieces), traced(Pieces)} || _ <- lists:seq(1, 5)],
    Median = fun(L) -> round(convoy_bench_stats:median(L)) end,
    io:format("the seed's 10 MB {Pid, Binary}, sent and answered (median of 5, us):~n"),
    io:format("  ~-44s ~8b~n", ["whole, by !", Median([P || {P, _, _} <- Rows])]),
    io:format("  ~-44s ~8b~n", ["in pieces, by convoy:send/2", Median([C || {_, C, _} <- Rows])]),
    [io:format("  ~-44s ~8b~n", [Label, Median([element(I, T) || {_, _, T} <- Rows])])
     || {I, Label} <- [{1, "  traced: first piece acknowledged"},
                       {2, "  traced: last piece acknowledged"},
                       {3, "  traced: delivered (joined and decoded)"}]],
    application:stop(convoy),
    peer:stop(Peer).

%% @doc The timeline's sink: answers each binary with `is_binary/1' of it, by `!'.
-spec sink() -> no_return().
sink() ->
    receive {From, Bin} -> From ! is_binary(Bin) end,
    sink().

us(F) ->
    {Us, ok} = timer:tc(F),
    Us.

%% The send traced by a process of its own: when the acknowledgements of the
%% first and last pieces and the delivery arrived, in microseconds from the call.
traced(F) ->
    Self = self(),
    Tracer = spawn_link(fun() -> receive go -> Self ! {acks, acks([])} end end),
    erlang:trace(Self, true, ['receive', monotonic_timestamp, {tracer, Tracer}]),
    T0 = erlang:monotonic_time(),
    F(),
    erlang:trace(Self, false, ['receive']),
    Tracer ! go,
    Acks = receive {acks, Got} -> Got end,
    Since = fun(T) -> erlang:convert_time_unit(T - T0, native, microsecond) end,
    [{0, First} | _] = Acks,
    {_, Last} = lists:last([Ack || Ack = {Seq, _} <- Acks, is_integer(Seq)]),
    {delivered, Done} = lists:keyfind(delivered, 1, Acks),
    {Since(First), Since(Last), Since(Done)}.

acks(Acc) ->
    receive
        {trace_ts, _, 'receive', {_Alias, convoy_piece, What}, Ts} -> acks([{What, Ts} | Acc]);
        {trace_ts, _, 'receive', _Other, _Ts} -> acks(Acc)
    after 200 ->
        lists:reverse(Acc)
    end.
