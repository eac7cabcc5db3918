%% The harness's `flow' scenario (seed 004): a producer and a consumer slower than
%% the network, the consumer on the producer's node or on another; flooding,
%% syncing every `every' items, or through a `convoy_channel'. What it measures:
%% the consumer's peak queue and memory beside the rate.
-module(convoy_bench_flow).

-export([measure/2]).
%% Spawned on the consumer's node.
-export([slow_consumer/4]).

-import(convoy_bench_measure, [snd/3, timeout/1, secs/1]).

%% @doc One `flow' point: `N' items, `Work' hashes each at the consumer.
-spec measure(map(), convoy_bench_measure:ctx()) -> convoy_bench_measure:figures().
measure(#{mode := FlowMode, where := Where, n := N, work := Work, every := Every} = P,
        Ctx = #{mode := M}) ->
    Node = case Where of
               same -> node();
               cross -> convoy_bench_measure:sink(Ctx)
           end,
    C = spawn_opt(Node, ?MODULE, slow_consumer, [M, Work, 0, {0, 0}],
                  [{message_queue_data, off_heap}]),
    T0 = erlang:monotonic_time(),
    Done = case FlowMode of
               channel -> channel_produce(C, N, P, Ctx);
               _ -> produce(FlowMode, M, C, 1, N, Every, Ctx),
                    fun() -> snd(M, C, {done, self()}) end
           end,
    Tp = erlang:monotonic_time(),
    Done(),
    {Count, MaxQ, MaxMem} = receive
                                {done, C, Cnt, Q, Mem} -> {Cnt, Q, Mem}
                            after timeout(Ctx) -> exit({timeout, flow_consumer})
                            end,
    T1 = erlang:monotonic_time(),
    Count =:= N orelse exit({lost, N - Count}),
    #{total_ms => 1000 * secs(T1 - T0), producer_ms => 1000 * secs(Tp - T0),
      msg_s => N / secs(T1 - T0), max_backlog => MaxQ, peak_mem => MaxMem}.

produce(_FlowMode, _M, _C, I, N, _Every, _Ctx) when I > N -> ok;
produce(sync, M, C, I, N, Every, Ctx) when I rem Every =:= 0 ->
    snd(M, C, {item, I}),
    snd(M, C, {sync, self()}),
    receive synced -> ok after timeout(Ctx) -> exit({timeout, sync}) end,
    produce(sync, M, C, I + 1, N, Every, Ctx);
produce(FlowMode, M, C, I, N, Every, Ctx) ->
    snd(M, C, {item, I}),
    produce(FlowMode, M, C, I + 1, N, Every, Ctx).

%% N items through a credit channel; returns the fun that sends `done' (through
%% the channel too, so it comes after every item) and closes the channel.
channel_produce(C, N, #{window := W, ack_every := A}, Ctx) ->
    Opts = case A of
               0 -> #{window => W};
               _ -> #{window => W, ack_every => A}
           end,
    {ok, Ch} = convoy_channel:open(C, Opts#{timeout => timeout(Ctx)}),
    ok = channel_send(Ch, 1, N),
    fun() ->
            ok = convoy_channel:send(Ch, {done, self()}),
            ok = convoy_channel:close(Ch)
    end.

channel_send(_Ch, I, N) when I > N -> ok;
channel_send(Ch, I, N) ->
    case convoy_channel:send(Ch, {item, I}) of
        ok -> channel_send(Ch, I + 1, N);
        {error, Reason} -> exit({channel, Reason, I})
    end.

%% @doc A consumer slower than the network: `Work' hashes per item. Checks its
%% queue length after every item and its process memory (which includes the
%% messages queued) every 1000 items, and reports the peaks. Items come as
%% `{item, I}' or, through a credit channel, `{convoy_channel, Token, {item, I}}'
%% (acked once processed).
-spec slow_consumer(convoy_bench_measure:mode(), non_neg_integer(), non_neg_integer(),
                    {non_neg_integer(), non_neg_integer()}) -> ok.
slow_consumer(M, Work, Count, Peaks) ->
    receive
        {item, I} ->
            burn(Work, I),
            slow_consumer(M, Work, Count + 1, peaks(Count + 1, Peaks));
        {convoy_channel, Token, {item, I}} ->
            burn(Work, I),
            ok = convoy_channel:ack(Token),
            slow_consumer(M, Work, Count + 1, peaks(Count + 1, Peaks));
        {sync, From} ->
            snd(M, From, synced),
            slow_consumer(M, Work, Count, Peaks);
        {convoy_channel, Token, {done, From}} ->
            ok = convoy_channel:ack(Token),
            report_done(M, From, Count, Peaks);
        {done, From} ->
            report_done(M, From, Count, Peaks)
    end.

report_done(M, From, Count, Peaks) ->
    {MaxQ, MaxMem} = peaks(1000, Peaks),
    snd(M, From, {done, self(), Count, MaxQ, MaxMem}).

peaks(Count, {MaxQ, MaxMem}) ->
    {message_queue_len, Q} = process_info(self(), message_queue_len),
    case Count rem 1000 of
        0 ->
            {memory, Mem} = process_info(self(), memory),
            {max(MaxQ, Q), max(MaxMem, Mem)};
        _ ->
            {max(MaxQ, Q), MaxMem}
    end.

burn(0, _I) -> ok;
burn(K, I) -> _ = erlang:phash2({I, K}), burn(K - 1, I).
