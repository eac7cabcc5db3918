%% PropEr property of `compress => auto''s meter (`convoy_compress_auto'), run
%% from EUnit: a lane streams a node's busy run of lots of 1,000 messages through a pipe
%% that holds `Depth' lots, takes `Latency' microseconds to cross and delivers a
%% lot in `Cost(Mode)' microseconds at its slowest stage, plain or compressed
%% (the link, or the receiver's CPU: the meter cannot tell which, nor need to),
%% the pipe deep enough for its latency. Each lot is sent in the mode the meter
%% set last, and answered when delivered.
%%
%% Whatever the costs, the pipe and its latency: when one mode is clearly the
%% faster (by a quarter or more), the time spent delivering lots in the slower
%% one stays within what finding out costs once (the lots already on their way
%% when it was tried, and its measure: `SAMPLES' lots and `MIN_SPAN_US') and a
%% 1/8 of the time after it; and the last third of the lots spend less than half
%% of their time in the slower mode.
-module(prop_convoy_compress_auto_tests).

-export([prop_finds_faster_mode/0]).

-include_lib("proper/include/proper.hrl").
-include_lib("eunit/include/eunit.hrl").

-define(LOTS, 3000).
%% convoy_compress_auto's SAMPLES and MIN_SPAN_US
-define(SAMPLES, 8).
-define(MIN_SPAN_US, 20000).

finds_faster_mode_test_() ->
    {timeout, 300,
     ?_assertEqual(ok, convoy_prop:check(prop_finds_faster_mode(),
                                         [{numtests, 500}, {to_file, user}]))}.

prop_finds_faster_mode() ->
    ?FORALL({Plain, Zip, Depth, Latency},
            ?LET({P, Z, D}, {choose(100, 5000), choose(100, 5000), choose(2, 40)},
                 %% a pipe deep enough for its latency: the slowest stage, not
                 %% the window, sets the pace
                 {P, Z, D, choose(0, (D - 1) * min(P, Z))}),
            ?IMPLIES(max(Plain, Zip) >= 1.25 * min(Plain, Zip),
                     begin
                         Costs = #{plain => Plain, zip => Zip},
                         {Total, Slow, {LateSlow, Late}} = run(Costs, Depth, Latency),
                         Slower = case Plain < Zip of
                                      true -> zip;
                                      false -> plain
                                  end,
                         Once = 2 * ((Depth + ?SAMPLES + 2) * maps:get(Slower, Costs)
                                     + ?MIN_SPAN_US + Latency),
                         ?WHENFAIL(io:format(user, "total ~b us, ~b us in ~p (bound ~b), "
                                             "last third ~b of ~b us~n",
                                             [Total, Slow, Slower, Once + Total div 8,
                                              LateSlow, Late]),
                                   Slow =< Once + Total div 8
                                   andalso LateSlow < Late div 2)
                     end)).

%% Returns the time to deliver every lot, the time spent delivering lots in the
%% slower mode, and the time the last third of the lots took in it and in all.
run(Costs, Depth, Latency) ->
    Ref = make_ref(),
    {Level, Ms} = convoy_compress_auto:level(n@h, convoy_compress_auto:new()),
    Slower = case maps:get(plain, Costs) > maps:get(zip, Costs) of
                 true -> plain;
                 false -> zip
             end,
    St = #{ms => Ms, mode => mode(Level), now => 0, done => 0, pipe => queue:new(),
           slow => 0, costs => Costs, depth => Depth, latency => Latency, ref => Ref,
           slower => Slower, late => {0, 0}},
    #{done := Total, slow := Slow, late := Late} = send(1, St),
    {Total, Slow, Late}.

send(Lot, St) when Lot > ?LOTS ->
    answer_all(St);
send(Lot, St0) ->
    St = #{now := Now, done := Done, mode := Mode, pipe := Pipe, costs := Costs,
           latency := Latency, slow := Slow, slower := Slower} = room(St0),
    Cost = maps:get(Mode, Costs),
    Delivered = max(Done, Now + Latency) + Cost,
    SlowCost = case Mode of
                   Slower -> Cost;
                   _ -> 0
               end,
    {LateSlow, Late} = maps:get(late, St),
    Late1 = case Lot > ?LOTS - ?LOTS div 3 of
                true -> {LateSlow + SlowCost, Late + Cost};
                false -> {LateSlow, Late}
            end,
    send(Lot + 1, St#{done := Delivered, pipe := queue:in({Lot, Mode, Now, Delivered}, Pipe),
                      slow := Slow + SlowCost, late := Late1}).

%% The lane sends once the pipe has room (its blocking send returns), and reads
%% every answer in by then.
room(St = #{pipe := Pipe, depth := Depth, now := Now}) ->
    case queue:peek(Pipe) of
        {value, {_, _, _, At}} when At =< Now -> room(answer(St));
        {value, {_, _, _, At}} -> case queue:len(Pipe) >= Depth of
                                      true -> room(answer(St#{now := At}));
                                      false -> St
                                  end;
        empty -> St
    end.

answer_all(St = #{pipe := Pipe}) ->
    case queue:is_empty(Pipe) of
        true -> St;
        false -> answer_all(answer(St))
    end.

%% The oldest lot delivered: its answer to the meter (the first lot, which
%% started the busy run, carries none), and the level it says.
answer(St = #{pipe := Pipe, ms := Ms, ref := Ref, now := Now}) ->
    {{value, {Lot, Mode, _Sent, At}}, Pipe1} = queue:out(Pipe),
    St1 = St#{pipe := Pipe1, now := max(Now, At)},
    case Lot of
        1 ->
            St1;
        _ ->
            case convoy_compress_auto:answered(n@h, {Ref, Lot, Mode, 1000}, At, Ms) of
                {Ms1, none} -> St1#{ms := Ms1};
                {Ms1, {level, L}} -> St1#{ms := Ms1, mode := mode(L)};
                {Ms1, {chosen, _, L, _}} -> St1#{ms := Ms1, mode := mode(L)}
            end
    end.

mode(never) -> plain;
mode(_Level) -> zip.
